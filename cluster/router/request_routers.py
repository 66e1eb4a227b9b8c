"""Serve request routers for the two pools (Ray Serve's custom RequestRouter API).

Replicas report `record_routing_stats()` every `ROUTING_STATS_PERIOD_S`; between reports the
router's own queue-length cache (requests it sent and that have not finished) breaks ties.

  DecodeRouter   most free KV blocks, then fewest running + waiting requests
  PrefillRouter  fewest queued prompt tokens
In both, a call carrying `replica_id=` (acks, KV control calls) goes to that replica, or
anywhere if it is gone (an ack is then counted as late; a control call is refused as stale).
"""

from __future__ import annotations

from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

ROUTING_STATS_PERIOD_S = 0.5


class _Ranked(RequestRouter):
    def _queued(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    def _key(self, replica: RunningReplica) -> tuple[Any, ...]:
        raise NotImplementedError

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        want = pending_request.kwargs.get("replica_id") if pending_request is not None else None
        if want:  # acks and KV control calls go to the replica they name
            pinned = [r for r in candidate_replicas if r.replica_id.unique_id == want]
            if pinned:
                return [pinned]
        return [[r] for r in sorted(candidate_replicas, key=self._key)]


class DecodeRouter(_Ranked):
    def _key(self, replica: RunningReplica) -> tuple[Any, ...]:
        s = replica.routing_stats or {}
        busy = s.get("num_running", 0) + s.get("num_waiting", 0)
        return (-s.get("free_blocks", 0) // 64, busy + self._queued(replica), self._queued(replica))


class PrefillRouter(_Ranked):
    def _key(self, replica: RunningReplica) -> tuple[Any, ...]:
        s = replica.routing_stats or {}
        return (s.get("queued_prompt_tokens", 0), self._queued(replica))
