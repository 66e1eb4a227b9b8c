"""The prefill half of the hand-off (cluster/kvtransfer/handoff.py): once R's prompt is computed
(a prefill-only request on the engine), send its KV to the decode side's receiver and hold R's
blocks under a lease until the ack. A plain object driven by PrefillServer (prefill/server.py);
every method runs on the engine thread.

    export(R's output, receiver)  → first token ended R: nothing held, nothing sent
                                  → else export_kv(R) but the blocks the receiver holds
                                  → connector.send → lease(R) starts
    ack(R)                        → release R's blocks (late acks are counted, ignored)
    reap()                        → release every R whose lease expired unacknowledged
    drop(R)                       → R's caller went away: release whatever R holds, now
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable

from cluster.engine.engine import LLMEngine
from cluster.engine.outputs import RequestOutput
from cluster.kvtransfer.base import KVConnector
from cluster.kvtransfer.errors import KVTransferError
from cluster.kvtransfer.handoff import PrefillHandoff, Receiver


class KVExporter:
    def __init__(self, engine: LLMEngine, connector: KVConnector, lease_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.connector = connector
        self.lease_s = lease_s
        self.clock = clock
        self.leases: dict[str, float] = {}
        self.counters: Counter[str] = Counter()

    def export(self, out: RequestOutput, receiver: Receiver) -> PrefillHandoff:
        """R's prefill-only run gave `out` (its first token): ship R's KV to `receiver` and start
        R's lease. On a send error R's blocks are freed and it raises."""
        request_id, done = out.request_id, out.outputs[0]
        if done.finish_reason is not None:  # ended on its first token: nothing held
            return PrefillHandoff(request_id, done.token_ids[0], (done.logprobs or [None])[0],
                                  finished=True, finish_reason=done.finish_reason,
                                  num_prompt_tokens=len(out.prompt_token_ids), num_cached_tokens=out.num_cached_tokens,
                                  prompt_logprobs=None if out.prompt_logprobs is None else out.prompt_logprobs[1:])
        result = self.engine.take_prefilled(request_id)
        try:  # not a lease yet: whatever fails here frees R's blocks at once
            # the leading blocks the receiver holds already (its prefix cache) are not sent
            payload = self.engine.export_kv(request_id, receiver.cached_blocks)
            sending = time.monotonic()
            receipt = self.connector.send(request_id, len(result.prompt_token_ids), payload, receiver)
        except BaseException as exc:
            self.engine.release(request_id)
            if isinstance(exc, KVTransferError):
                self.counters["send_failed"] += 1
            raise
        self.leases[request_id] = self.clock() + self.lease_s
        return PrefillHandoff(request_id, result.first_token, result.first_logprobs, receipt,
                              num_prompt_tokens=len(result.prompt_token_ids),
                              kv_send_s=time.monotonic() - sending, kv_bytes=payload.numel() * payload.element_size(),
                              prompt_logprobs=result.prompt_logprobs, num_cached_tokens=result.num_cached_tokens)

    def ack(self, request_id: str) -> bool:
        """The decode side is done with R's KV (landed or given up): free R's blocks."""
        if self.leases.pop(request_id, None) is None:
            self.counters["late_acks"] += 1
            return False
        self.engine.release(request_id)
        self.counters["acked"] += 1
        return True

    def drop(self, request_id: str) -> None:
        """R's caller went away: free whatever R holds (queued, computing, held or leased)."""
        self.leases.pop(request_id, None)
        self.engine.abort_request(request_id)
        self.counters["cancelled"] += 1

    def reap(self) -> list[str]:
        now = self.clock()
        expired = [rid for rid, deadline in self.leases.items() if deadline <= now]
        for rid in expired:
            del self.leases[rid]
            self.engine.release(rid)
            self.counters["lease_expired"] += 1
        return expired

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "leases": len(self.leases), **self.counters,
                **{f"kv_{k}": v for k, v in self.connector.stats().items()}}
