"""The prefill half of the hand-off (cluster/kvtransfer/handoff.py): once R's prompt is computed
(a prefill-only request on the engine), pack its KV, send it to the decode side's receiver and
hold R's blocks under a lease until the ack. A plain object driven by PrefillServer
(prefill/server.py): `send` touches no engine state and runs off the engine thread (a slow
transfer holds up no step); every other method runs on it.

    pack(R's output, receiver)  → first token ended R: a finished PrefillHandoff, nothing held
                                → else R's KV packed, but the blocks the receiver holds
    send(R's packed KV)         → connector.send → the PrefillHandoff (on an error: fail(R))
    lease(R, receipt)           → R's blocks, and what its receipt refers to, are held until
                                  ack(R) or the lease expires
    ack(R)                      → release R's blocks (late acks are counted, ignored)
    reap()                      → release every R whose lease expired unacknowledged
    fail(R) / drop(R)           → the send failed / R's caller went away: release R's blocks now
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, NamedTuple

import torch

from cluster.engine.engine import LLMEngine
from cluster.engine.outputs import PrefillResult, RequestOutput
from cluster.kvtransfer.base import KVConnector
from cluster.kvtransfer.errors import KVTransferError
from cluster.kvtransfer.handoff import PrefillHandoff, Receipt, Receiver


class PackedKV(NamedTuple):
    """R's prompt KV packed for the connector, with what its hand-off carries."""

    result: PrefillResult
    payload: torch.Tensor  # [L, 2, n, block_size, Hkv, D]


class Lease(NamedTuple):
    deadline: float  # the exporter's clock
    receipt: Receipt  # held with the blocks: what R's KV is reached by until the ack


class KVExporter:
    def __init__(self, engine: LLMEngine, connector: KVConnector, lease_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.engine = engine
        self.connector = connector
        self.lease_s = lease_s
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.counters: Counter[str] = Counter()

    def pack(self, out: RequestOutput, receiver: Receiver) -> PrefillHandoff | PackedKV:
        """R's prefill-only run gave `out` (its first token): R's KV to send, or, when the first
        token already ended R, its finished hand-off."""
        request_id, done = out.request_id, out.outputs[0]
        if done.finish_reason is not None:  # ended on its first token: nothing held
            return PrefillHandoff(request_id, done.token_ids[0], (done.logprobs or [None])[0],
                                  finished=True, finish_reason=done.finish_reason,
                                  num_prompt_tokens=len(out.prompt_token_ids), num_cached_tokens=out.num_cached_tokens,
                                  prompt_logprobs=None if out.prompt_logprobs is None else out.prompt_logprobs[1:])
        result = self.engine.take_prefilled(request_id)
        try:  # the leading blocks the receiver holds already (its prefix cache) are not sent
            return PackedKV(result, self.engine.export_kv(request_id, receiver.cached_blocks))
        except BaseException:
            self.engine.release(request_id)
            raise

    def send(self, packed: PackedKV, receiver: Receiver) -> PrefillHandoff:
        """Ship R's packed KV to `receiver` (any thread: no engine state). On an error, call
        `fail(R)` on the engine thread."""
        result, payload = packed
        sending = time.monotonic()
        try:
            receipt = self.connector.send(result.request_id, len(result.prompt_token_ids), payload, receiver)
        except KVTransferError:
            self.counters["send_failed"] += 1
            raise
        return PrefillHandoff(result.request_id, result.first_token, result.first_logprobs, receipt,
                              num_prompt_tokens=len(result.prompt_token_ids),
                              kv_send_s=time.monotonic() - sending, kv_bytes=payload.numel() * payload.element_size(),
                              prompt_logprobs=result.prompt_logprobs, num_cached_tokens=result.num_cached_tokens)

    def lease(self, request_id: str, receipt: Receipt) -> None:
        """R's KV was sent: its blocks stay held until the ack, or `lease_s` from now, and so
        does `receipt`. A shared_store receipt refers to R's KV in Ray's object store; owned by
        this process, it would otherwise live on only through the decode side's borrowed
        reference, which reaches Ray's reference counting nested in the hand-off, and twice in a
        64-request burst such an object was gone before the decode side read it (docs/performance.md)."""
        self.leases[request_id] = Lease(self.clock() + self.lease_s, receipt)

    def fail(self, request_id: str) -> None:
        """R's send failed (not a lease yet): free its blocks at once."""
        self.engine.release(request_id)

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
        expired = [rid for rid, lease in self.leases.items() if lease.deadline <= now]
        for rid in expired:
            del self.leases[rid]
            self.engine.release(rid)
            self.counters["lease_expired"] += 1
        return expired

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), "leases": len(self.leases), **self.counters,
                **{f"kv_{k}": v for k, v in self.connector.stats().items()}}
