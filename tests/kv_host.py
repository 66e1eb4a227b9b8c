"""A Ray actor hosting one engine with prefill and decode workers over a named connector.

Test scaffolding only: the cluster's real deployments (issue 4) are thin shells of the same
plain workers. Fault hooks reach the connector's raw `_transmit` to send bad bytes on purpose.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import ray
import torch


@ray.remote(max_concurrency=4)
class KVHost:
    def __init__(self, connector: str, model: str | None, engine_args: dict[str, Any],
                 connector_options: dict[str, Any] | None = None, lease_s: float = 30.0,
                 policy: str = "recompute") -> None:
        torch.set_num_threads(1)
        from cluster.config import EngineConfig
        from cluster.decode.importer import KVImporter
        from cluster.engine.engine import LLMEngine
        from cluster.kvtransfer.connectors import create_connector
        from cluster.prefill.exporter import KVExporter

        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))
        self.conn = create_connector(connector, self.engine.kv_layout(), **(connector_options or {}))
        self.exporter = KVExporter(self.engine, self.conn, lease_s)
        self.importer = KVImporter(self.engine, self.conn, policy)

    def configure(self, lease_s: float | None = None, policy: str | None = None) -> None:
        """Change the exporter's lease or the importer's failure policy (a test's own setting on a
        host its module's tests share)."""
        if lease_s is not None:
            self.exporter.lease_s = lease_s
        if policy is not None:
            self.importer.policy = policy

    def kv_control(self, op: str, args: dict[str, Any]) -> Any:
        return self.conn.on_control(op, args)

    # -- prefill side ----------------------------------------------------------------
    def prefill(self, rid: str, prompt: list[int], params, receiver):
        """What PrefillServer does, stepping the engine here: R prefill-only, then its export."""
        self.engine.add_request(rid, prompt, params, prefill_only=True)
        out = None
        while out is None:
            out = next((o for o in self.engine.step() if o.request_id == rid), None)
        from cluster.kvtransfer.handoff import PrefillHandoff

        packed = self.exporter.pack(out, receiver)
        if isinstance(packed, PrefillHandoff):  # the first token ended R
            return packed
        try:
            handoff = self.exporter.send(packed, receiver)
        except BaseException:
            self.exporter.fail(rid)
            raise
        self.exporter.lease(rid, handoff.receipt)
        return handoff

    def prefill_and_hold(self, rid: str, prompt: list[int], params) -> str:
        """Prefill only and keep the blocks, returning the payload's sha256 (for raw sends)."""
        self.engine.add_request(rid, prompt, params, prefill_only=True)
        while not any(o.request_id == rid for o in self.engine.step()):
            pass
        self._held = self.engine.take_prefilled(rid)
        return hashlib.sha256(self.engine.export_kv(rid).view(torch.uint8).numpy().tobytes()).hexdigest()

    def send_raw(self, rid: str, receiver, mode: str):
        """Send the held request's KV with a deliberate defect; always releases the blocks."""
        from cluster.kvtransfer.wire import make_header

        try:
            payload = self.engine.export_kv(rid)
            header, view = make_header(rid, len(self._held.prompt_token_ids), payload, self.conn.layout)
            data = bytearray(view)
            if mode == "corrupt":
                data[len(data) // 2] ^= 0x40
            elif mode == "truncate":
                data = data[:-64]
            elif mode == "pad":
                data = data + bytearray(64)
            elif mode == "declare_huge":
                header = dataclasses.replace(header, payload_bytes=self.conn.max_payload_bytes + 1)
            return self.conn._transmit(header, memoryview(data), receiver)
        finally:
            self.engine.release(rid)

    def ack(self, rid: str) -> bool:
        return self.exporter.ack(rid)

    def reap(self) -> list[str]:
        return self.exporter.reap()

    # -- decode side -----------------------------------------------------------------
    def reserve(self, rid: str, prompt: list[int], params):
        return self.importer.reserve(rid, prompt, params)

    def start(self, rid: str, handoff) -> list[int]:
        self.importer.start(rid, handoff)
        return self._finish(rid)

    def abandon(self, rid: str) -> list[int]:
        self.importer.abandon(rid)
        return self._finish(rid)

    def imported_sha(self, rid: str, receipt) -> str:
        """Receive + import, then re-pack the decode side's own blocks and hash them."""
        packed = self.conn.receive(rid, receipt)
        req = self.engine.scheduler.remote[rid]
        self.engine.import_kv(rid, packed)
        ours = self.engine.runner.export_kv(req.block_ids)
        self.engine.finish_remote(rid, ok=True, first_token=0)
        self._finish(rid)
        return hashlib.sha256(ours.view(torch.uint8).numpy().tobytes()).hexdigest()

    def generate_local(self, prompt: list[int], params) -> list[int]:
        rid = f"local-{len(prompt)}-{id(prompt)}"
        self.engine.add_request(rid, prompt, params)
        return self._finish(rid)

    def _finish(self, rid: str) -> list[int]:
        tokens: list[int] = []
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.request_id == rid:
                    tokens = out.outputs[0].token_ids
        return tokens

    def receive_error(self, rid: str, receipt, timeout_s: float) -> str | None:
        """Try to receive; the error's class name (None if it landed). Frees R's blocks after."""
        from cluster.kvtransfer.errors import KVTransferError

        try:
            self.conn.receive(rid, receipt, timeout_s)
            error = None
        except KVTransferError as exc:
            error = f"{type(exc).__name__}: {exc}"
        self.engine.abort_request(rid)
        return error

    def stats(self) -> dict[str, Any]:
        return {**self.engine.stats(), **self.exporter.counters, **self.importer.counters,
                **{f"kv_{k}": v for k, v in self.conn.stats().items()}}

    def pid(self) -> int:
        import os

        return os.getpid()
