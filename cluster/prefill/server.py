"""A prefill replica as a plain asyncio object: one engine thread runs prompts one after the
other (each prompt's chunks fill the step budget), acks free leases, a timer reaps expired ones.
Prompts run in arrival order, or by (priority, arrival) under `scheduling_policy: priority`
(prefill/turns.py).

The Serve deployment (cluster/prefill/deployment.py) is a thin shell over this class.
"""

from __future__ import annotations

import asyncio
import dataclasses
import concurrent.futures
import contextlib
import threading
import time
from typing import Any, Sequence

from cluster.autoscaling import QUEUED_TOKENS
from cluster.config import AppConfig
from cluster.engine.engine import LLMEngine
from cluster.kvtransfer.connectors import create_connector
from cluster.prefill.turns import Turns
from cluster.kvtransfer.handoff import PrefillHandoff, Receiver
from cluster.prefill.exporter import KVExporter
from cluster.cache_report import cache_report
from cluster.sampling_params import SamplingParams


class PrefillServer:
    def __init__(self, config: AppConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.engine = engine or LLMEngine(config.prefill_engine)
        kv = config.kv_transfer
        self.connector = create_connector(kv.connector, self.engine.kv_layout(),
                                          **kv.connector_options(role="prefill"))
        self.exporter = KVExporter(self.engine, self.connector, lease_s=kv.lease_s)
        # The engine is single-threaded: every call that touches it runs on this one thread.
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tandem-prefill")
        # request id → (prompt tokens, of which not cached on arrival): from arrival to hand-off
        self.queued: dict[str, tuple[int, int]] = {}
        self._reaper: asyncio.Task | None = None
        self.last_abort_at = 0.0  # wall time a cancelled request's blocks were last released
        self._job_started_at: float | None = None
        self.turns = Turns() if config.engine.scheduler.scheduling_policy == "priority" else None

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      receiver: Receiver) -> PrefillHandoff:
        self._ensure_reaper()
        prompt = list(prompt_token_ids)
        cached = self.engine.blocks.cached_prefix_len(prompt, params.cache_salt) if self.config.prefix_aware_routing else 0
        self.queued[request_id] = (len(prompt), len(prompt) - cached)
        arrived = time.monotonic()
        try:
            async with self.turns.turn(params.priority) if self.turns else contextlib.nullcontext():
                handoff = await self._run(self.exporter.prefill, request_id, prompt, params, receiver)
            return dataclasses.replace(handoff, prefill_s=time.monotonic() - arrived)
        except asyncio.CancelledError:
            # The decode side (and its client) went away. A queued job never starts; a running
            # one stops at its next step; a finished one's held blocks are released by `drop`,
            # which runs after it on the engine thread.
            self.exporter.cancel(request_id)
            with contextlib.suppress(RuntimeError):  # shutting down: nothing left to release
                self._executor.submit(self._dropped, request_id)
            raise
        finally:
            self.queued.pop(request_id, None)

    def _dropped(self, request_id: str) -> None:
        self.exporter.drop(request_id)
        self.last_abort_at = time.time()

    async def ack(self, request_id: str) -> bool:
        return await self._run(self.exporter.ack, request_id)

    async def stats(self) -> dict[str, Any]:
        # Read here, not on the engine thread: a long prefill would hold the snapshot back for
        # its whole duration. Plain counters; a snapshot taken mid-step is still consistent enough.
        return {**self.exporter.stats(), "queued_prompt_tokens": sum(n for n, _ in self.queued.values()),
                "last_abort_at": self.last_abort_at, "histograms": self.connector.histograms()}

    def routing_stats(self) -> dict[str, Any]:
        """What the prefill pool's router ranks by (router/request_routers.py): the prompts queued
        here ([request id, its tokens to compute]) and what the prefix cache holds."""
        cache = cache_report(self.engine.blocks) if self.config.prefix_aware_routing else {}
        return {"queued": [[rid, work] for rid, (_, work) in list(self.queued.items())], **cache}

    def autoscaling_stats(self) -> dict[str, float]:
        """The load PrefillAutoscaling reads (cluster/autoscaling.py)."""
        return {QUEUED_TOKENS: sum(work for _, work in list(self.queued.values()))}

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._timed, fn, *args)

    def _timed(self, fn, *args):
        self._job_started_at = time.monotonic()
        try:
            return fn(*args)
        finally:
            self._job_started_at = None

    def check_health(self) -> None:
        """Raise if an engine job (a prompt's prefill, an ack) has made no progress (no engine
        step) for `stall_timeout_s`."""
        started = self._job_started_at
        if started is None:
            return
        stalled = time.monotonic() - max(started, self.exporter.last_step_at)
        if stalled > self.config.stall_timeout_s:
            raise RuntimeError(f"the prefill engine has made no progress for {stalled:.1f} s: wedged")

    def wedge(self) -> None:
        """Fault injection: occupy the engine thread for good (tests of the health check)."""
        self._executor.submit(self._timed, threading.Event().wait)

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        period = max(0.05, min(1.0, self.config.kv_transfer.lease_s / 4))
        while True:
            await asyncio.sleep(period)
            await self._run(self.exporter.reap)

    def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.connector.close()


class LocalPrefillClient:
    """A `PrefillClient` over a `PrefillServer` in the same process (tests, single-process use)."""

    def __init__(self, server: PrefillServer) -> None:
        self.server = server

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      receiver: Receiver) -> PrefillHandoff:
        return await self.server.prefill(request_id, prompt_token_ids, params, receiver)

    async def ack(self, handoff: PrefillHandoff) -> None:
        await self.server.ack(handoff.request_id)
