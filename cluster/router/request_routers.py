"""Serve request routers for the two pools (Ray Serve's custom RequestRouter API).

Replicas report `record_routing_stats()` every `ROUTING_STATS_PERIOD_S`; between reports the
router's own queue-length cache (requests it sent and that have not finished) breaks ties.

  PrefillRouter  least expected work before this prompt's first token: uncached prompt
                 tokens queued there, plus this prompt's tokens its prefix cache does not hold
                 (router/prefix_affinity.py)
  DecodeRouter   most free KV blocks, then fewest running + waiting requests, then the most of
                 the prompt cached (colocated: not computed again; disaggregated: not sent again)
In both, a call carrying `replica_id=` (acks, KV control calls) goes to that replica, or
anywhere if it is gone (an ack is then counted as late; a control call is refused as stale).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from cluster.router.prefix_affinity import CacheViews, QueueView

ROUTING_STATS_PERIOD_S = 0.5
PROMPT_CALLS = ("prefill", "generate")  # methods called as (request_id, prompt_token_ids, params)


class _Ranked(RequestRouter):
    def initialize_state(self, prefix_aware: bool = True, **kwargs: Any) -> None:
        self.prefix_aware = prefix_aware  # AppConfig.prefix_aware_routing
        self.caches = CacheViews()

    def _queued(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    def _cached(self, replica: RunningReplica, prompt: tuple[Any, ...] | None, memo: dict) -> int:
        if prompt is None or not self.prefix_aware:
            return 0
        _, token_ids, params = prompt
        return self.caches.cached_tokens(replica.replica_id.unique_id, replica.routing_stats or {},
                                         token_ids, params.cache_salt, memo)

    def _key(self, replica: RunningReplica, prompt: tuple[Any, ...] | None, memo: dict) -> tuple[Any, ...]:
        raise NotImplementedError

    def _chosen(self, replica: RunningReplica, prompt: tuple[Any, ...], memo: dict, call_id: str) -> None:
        """The first choice for a prompt call (Serve tries it first)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        want = pending_request.kwargs.get("replica_id") if pending_request is not None else None
        if want:  # acks and KV control calls go to the replica they name
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == want]
            if pinned:
                return [pinned]
        prompt = None
        if (pending_request is not None and pending_request.metadata.call_method in PROMPT_CALLS
                and len(pending_request.args) >= 3):
            prompt = tuple(pending_request.args[:3])
        memo: dict[int, list[bytes]] = {}
        ranked = sorted(candidate_replicas, key=lambda r: self._key(r, prompt, memo))
        if ranked and prompt is not None:
            self._chosen(ranked[0], prompt, memo, pending_request.metadata.internal_request_id)
        self.caches.forget({r.replica_id.unique_id for r in self.curr_replicas.values()})
        return [[r] for r in ranked]


class DecodeRouter(_Ranked):
    def _key(self, replica: RunningReplica, prompt: tuple[Any, ...] | None, memo: dict) -> tuple[Any, ...]:
        s = replica.routing_stats or {}
        busy = s.get("num_running", 0) + s.get("num_waiting", 0)
        return (-s.get("free_blocks", 0) // 64, busy + self._queued(replica),
                -self._cached(replica, prompt, memo), self._queued(replica))


class PrefillRouter(_Ranked):
    def initialize_state(self, prefix_aware: bool = True, **kwargs: Any) -> None:
        super().initialize_state(prefix_aware, **kwargs)
        self.queues = QueueView()

    def _key(self, replica: RunningReplica, prompt: tuple[Any, ...] | None, memo: dict) -> tuple[Any, ...]:
        s = replica.routing_stats or {}
        cost = self.queues.tokens(replica.replica_id.unique_id, s.get("queued", ()))
        if prompt is not None:
            cost += len(prompt[1]) - self._cached(replica, prompt, memo)
        return (cost, self._queued(replica))

    def _chosen(self, replica: RunningReplica, prompt: tuple[Any, ...], memo: dict, call_id: str) -> None:
        uncached = len(prompt[1]) - self._cached(replica, prompt, memo)
        self.queues.sent(prompt[0], replica.replica_id.unique_id, uncached, call_id)

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        # a nested call carries its caller's id: one decode request's prefill calls run one at a time
        self.queues.ended(internal_request_id)
