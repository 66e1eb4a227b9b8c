"""The prefill half of the hand-off (cluster/kvtransfer/handoff.py): compute R's prompt KV, send
it to the decode side's receiver, hold R's blocks under a lease until the ack. A plain object
driven by PrefillServer (prefill/server.py).

    prefill(R, prompt, params, receiver)  → engine runs R prefill-only → first token + held blocks
                                          → export_kv(R) but the blocks the receiver holds
                                          → connector.send → lease(R) starts
    ack(R)                                → release R's blocks (late acks are counted, ignored)
    reap()                                → release every R whose lease expired unacknowledged
    cancel(R) (any thread), then drop(R)  → the caller is gone: R stops at its next engine step,
                                            and whatever R holds is released at once
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Sequence

from cluster.engine.engine import LLMEngine
from cluster.kvtransfer.base import KVConnector
from cluster.kvtransfer.errors import KVTransferError
from cluster.kvtransfer.handoff import PrefillHandoff, Receiver
from cluster.sampling_params import SamplingParams


class PrefillCancelled(Exception):
    """R's caller went away while R was being prefilled; R's blocks are already freed."""


class KVExporter:
    def __init__(self, engine: LLMEngine, connector: KVConnector, lease_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.connector = connector
        self.lease_s = lease_s
        self.clock = clock
        self.leases: dict[str, float] = {}
        self.cancelled: set[str] = set()  # added from the event loop's thread, read between steps
        self.last_step_at = clock()  # progress heartbeat for the health check
        self.counters: Counter[str] = Counter()

    def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                receiver: Receiver) -> PrefillHandoff:
        """Prefill R, ship its KV to `receiver`; on a send error R's blocks are freed and it raises."""
        self.reap()
        engine = self.engine
        engine.add_request(request_id, prompt_token_ids, params, prefill_only=True)
        out = None
        try:
            while out is None:
                if request_id in self.cancelled:
                    raise PrefillCancelled(f"{request_id} was cancelled during its prefill")
                out = next((o for o in engine.step() if o.request_id == request_id), None)
                self.last_step_at = self.clock()
        except BaseException:
            engine.abort_request(request_id)
            raise
        done = out.outputs[0]
        if done.finish_reason is not None:  # ended on its first token: nothing held
            return PrefillHandoff(request_id, done.token_ids[0], (done.logprobs or [None])[0],
                                  finished=True, finish_reason=done.finish_reason,
                                  num_prompt_tokens=len(out.prompt_token_ids), num_cached_tokens=out.num_cached_tokens,
                                  prompt_logprobs=None if out.prompt_logprobs is None else out.prompt_logprobs[1:])
        result = engine.take_prefilled(request_id)
        try:  # not a lease yet: whatever fails here frees R's blocks at once
            # the leading blocks the receiver holds already (its prefix cache) are not sent
            payload = engine.export_kv(request_id, receiver.cached_blocks)
            sending = time.monotonic()
            receipt = self.connector.send(request_id, len(result.prompt_token_ids), payload, receiver)
        except BaseException as exc:
            engine.release(request_id)
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

    def cancel(self, request_id: str) -> None:
        """R's caller went away (safe from any thread): its prefill stops at the next step."""
        self.cancelled.add(request_id)

    def drop(self, request_id: str) -> None:
        """After `cancel(R)`, on the engine's thread: release whatever R still holds."""
        self.cancelled.discard(request_id)
        if self.leases.pop(request_id, None) is not None:
            self.engine.release(request_id)
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
