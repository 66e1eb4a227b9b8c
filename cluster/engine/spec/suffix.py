"""Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975): drafts from what followed the current
context before, in this request and in recent outputs of all requests, scored by frequency.

A suffix tree over a corpus answers "after this context, which tokens came next, how often".
The tree is walked here without being stored: the longest suffix of the request's tokens (up to
MAX_MATCH) that occurs earlier gives the tree node; the continuations of its occurrences are the
node's subtree. Two corpora, as in the paper:

    the request's own prompt + output    (copying from the input, repeated structure)
    a bounded corpus of recent outputs   (the same tool calls, templates, agent steps across
    of all finished requests             requests; GLOBAL_TOKENS at most, oldest dropped first)

The draft follows the most frequent child at each depth, while the path's estimated probability
(the product of each chosen child's share of its parent's count) stays >= MIN_TOKEN_PROB, and for
at most MAX_SPEC_FACTOR x the match length tokens (a one-token match drafts one token): only the
likeliest path is verified, not a tree. Per request nothing is kept (state is the token ids);
the global corpus is this replica's own, so a migrated stream keeps speculating on its own tokens.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Sequence

from cluster.config import SpeculativeConfig
from cluster.engine.spec.base import Proposer
from cluster.engine.spec.lookup import SEPARATOR, occurrences, pack
from cluster.engine.request import Request

MAX_MATCH = 16  # longest context matched
MAX_OCCURRENCES = 64  # latest occurrences of the context counted, per corpus
MIN_TOKEN_PROB = 0.1  # vLLM's suffix_decoding_min_token_prob default
MAX_SPEC_FACTOR = 1.0  # draft length <= this x match length (vLLM's suffix_decoding_max_spec_factor)
GLOBAL_TOKENS = 1 << 14  # recent outputs kept for the global corpus (each step scans it once per request)


class SuffixProposer(Proposer):
    name = "suffix"

    def __init__(self, config: SpeculativeConfig, global_tokens: int = GLOBAL_TOKENS) -> None:
        self.global_tokens = global_tokens
        self._outputs: deque[list[int]] = deque()
        self._size = 0
        self._corpus: list[int] = []
        self._packed = b""
        self._stale = False

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        if self._stale:
            self._rebuild()
        return [self._draft(r.token_ids, k) if k > 0 else [] for r, k in zip(requests, limits)]

    def finish(self, request: Request) -> None:
        output = request.output_token_ids
        if len(output) < 2 or len(output) > self.global_tokens:
            return
        self._outputs.append(list(output))
        self._size += len(output) + 1
        while self._size > self.global_tokens:
            self._size -= len(self._outputs.popleft()) + 1
        self._stale = True

    def _rebuild(self) -> None:
        corpus: list[int] = []
        for output in self._outputs:
            corpus.extend(output)
            corpus.append(SEPARATOR)
        self._corpus, self._packed, self._stale = corpus, pack(corpus), False

    def _draft(self, token_ids: list[int], k: int) -> list[int]:
        n = len(token_ids)
        own = pack(token_ids)
        end = (n - 1) * 4  # an occurrence in its own tokens must end before the last one

        def occurs(m: int) -> bool:
            pattern = own[(n - m) * 4:]
            return bool(occurrences(own, pattern, end, 1) or occurrences(self._packed, pattern, len(self._packed), 1))

        # a longer context cannot occur where a shorter one does not: the first miss ends the search
        # (searching up from 1 costs one full scan, the miss; a bisection would scan on each miss)
        lo = 0
        while lo < min(MAX_MATCH, n - 1) and occurs(lo + 1):
            lo += 1
        if lo == 0:
            return []
        pattern = own[(n - lo) * 4:]
        found = [token_ids[s + lo:s + lo + k] for s in occurrences(own, pattern, end, MAX_OCCURRENCES)]
        for s in occurrences(self._packed, pattern, len(self._packed), MAX_OCCURRENCES):
            follow = self._corpus[s + lo:s + lo + k]
            if SEPARATOR in follow:
                follow = follow[:follow.index(SEPARATOR)]
            found.append(follow)
        return likeliest_path([f for f in found if f], min(k, math.ceil(MAX_SPEC_FACTOR * lo)))


def likeliest_path(continuations: list[list[int]], k: int) -> list[int]:
    """The path down the tree of `continuations` that takes the most frequent child at each
    depth, while its probability (the product of child count / parent count) is >= MIN_TOKEN_PROB."""
    draft: list[int] = []
    prob = 1.0
    alive = continuations
    for depth in range(k):
        alive = [c for c in alive if len(c) > depth]
        if not alive:
            break
        token, count = Counter(c[depth] for c in alive).most_common(1)[0]
        prob *= count / len(alive)
        if prob < MIN_TOKEN_PROB:
            break
        draft.append(token)
        alive = [c for c in alive if c[depth] == token]
    return draft
