"""Prefix-cache-aware routing: send a prompt where its prefix is already cached, unless the
time saved is lost waiting behind other prompts there.

A replica reports, with its routing stats, what its prefix cache holds (`cache_report`): the
first 8 bytes of the chained hash of up to DIGEST_LIMIT cached blocks (in use first, then the
last to be evicted), and its block size. The router hashes the prompt the same way
(block_manager.extend_chain, the same salt rule) and counts the leading blocks a replica holds:
the chain makes block i's hash stand for the whole prefix before it, and the engine's own
lookup stops at the first miss too.

    cost(replica) = tokens queued there to compute        (`QueueView`: each queued prompt's
                                                           tokens not cached on its arrival)
                  + the prompt's tokens not cached there

The lowest cost is the replica expected to finish this prompt first. A replica's report lists
the prompts queued there, but lags by up to a period (0.5 s) and is resent only when it
changes: the router corrects it with what it has seen since. A prompt it has sent counts at
once (so a burst inside one period, all seeing the same stats, does not pile onto one replica)
until a report lists it; one whose call has ended stops counting even while a stale report
still lists it (else a conversation's next turn, sent right after the last one, would find its
replica "busy" with it).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from cluster.cache_report import HASH_BYTES, prompt_hashes

CORRECTION_TTL_S = 5.0  # how long the router's own corrections outlive what a report can lag


class CacheViews:
    """Each replica's reported cache as a set, rebuilt only when its report changes."""

    def __init__(self) -> None:
        self._views: dict[str, tuple[bytes, frozenset[bytes]]] = {}

    def cached_tokens(self, replica: str, stats: dict[str, Any], token_ids: Sequence[int],
                      salt: str | None, memo: dict[int, list[bytes]]) -> int:
        """Prompt tokens `replica` holds in its prefix cache, per its last report; `memo` keeps
        the prompt's hashes per block size across the replicas of one choice."""
        blob, block_size = stats.get("cached_blocks"), stats.get("block_size")
        if not blob or not block_size:
            return 0
        seen = self._views.get(replica)
        if seen is None or seen[0] != blob:
            seen = (blob, frozenset(blob[i:i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)))
            self._views[replica] = seen
        if block_size not in memo:
            memo[block_size] = prompt_hashes(token_ids, block_size, salt)
        held = 0
        for h in memo[block_size]:
            if h not in seen[1]:
                break
            held += 1
        return held * block_size

    def forget(self, live: set[str]) -> None:
        for replica in [r for r in self._views if r not in live]:
            del self._views[replica]


class QueueView:
    """The tokens queued at each replica to compute: its last report, corrected by what this
    router has seen since (reports lag by up to a period, and are sent only when they change)."""

    def __init__(self, clock=time.monotonic) -> None:
        self._clock = clock
        self._sent: dict[str, tuple[str, int, float, str]] = {}  # request id → (replica, tokens, when, call)
        self._ended: dict[str, float] = {}  # request id → when its call ended

    def sent(self, request_id: str, replica: str, tokens: int, call_id: str) -> None:
        self._sent[request_id] = (replica, tokens, self._clock(), call_id)

    def ended(self, call_id: str) -> None:
        """The call ended (answered, failed or cancelled): its prompt is no longer queued."""
        for rid in [r for r, entry in self._sent.items() if entry[3] == call_id]:
            del self._sent[rid]
            self._ended[rid] = self._clock()

    def tokens(self, replica: str, reported: Sequence[tuple[str, int]]) -> int:
        """Tokens queued at `replica`: those its report lists (request id, tokens), less the
        requests this router has seen end since, plus those it sent there that the report
        does not list yet."""
        expired = self._clock() - CORRECTION_TTL_S  # older than any report's lag
        for rid in [r for r, entry in self._sent.items() if entry[2] < expired]:
            del self._sent[rid]  # a call never sent, whose end is never seen
        for rid in [r for r, at in self._ended.items() if at < expired]:
            del self._ended[rid]
        listed = {rid for rid, _ in reported}
        return (sum(n for rid, n in reported if rid not in self._ended)
                + sum(entry[1] for rid, entry in self._sent.items() if entry[0] == replica and rid not in listed))
