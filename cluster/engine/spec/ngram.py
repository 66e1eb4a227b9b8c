"""Prompt lookup (n-gram) drafting: the longest suffix of prompt + output, from
`prompt_lookup_max` down to `prompt_lookup_min` tokens, found earlier in the same sequence
proposes the tokens that followed its latest occurrence. Pays where the reply copies its input
(rewrites, summaries, code edits); proposes nothing where no suffix recurs."""

from __future__ import annotations

from typing import Sequence

from cluster.config import SpeculativeConfig
from cluster.engine.spec.base import Proposer
from cluster.engine.spec.lookup import occurrences, pack
from cluster.engine.request import Request


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        return [ngram_draft(r.token_ids, k, self.min_n, self.max_n) if k > 0 else []
                for r, k in zip(requests, limits)]


def ngram_draft(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The `k` tokens after the latest earlier occurrence of the longest suffix of
    `token_ids` between max_n and min_n tokens long; [] when none recurs."""
    n = len(token_ids)
    data = pack(token_ids)
    for size in range(min(max_n, n - 1), min_n - 1, -1):
        # an occurrence that ends before the last token, so at least one token follows it
        found = occurrences(data, data[(n - size) * 4:], (n - 1) * 4, 1)
        if found:
            follow = found[0] + size
            return token_ids[follow:follow + k]
    return []
