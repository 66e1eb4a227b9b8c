"""A prefill replica as a plain asyncio object over the same engine driver as decode
(AsyncEngine): each prompt is a prefill-only request on the engine's queue, so the scheduler
batches several prompts into one step (chunked, within `max_num_batched_tokens`): under
`prefill_schedule: ttft` (default) the earliest arrival + own compute time first, and only as
many per step as shortens the average time to first token, from the step cost this replica
measures, and a short prompt passes a long one between its chunks (engine/scheduler.py); under
`scheduling_policy: priority`, by priority first. When R's prompt is computed,
the exporter (prefill/exporter.py) packs its KV on the engine thread and sends it off it, then
holds R's blocks under a lease; acks free them, a timer reaps expired leases.

The Serve deployment (cluster/prefill/deployment.py) is a thin shell over this class.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from typing import Any, Sequence

from cluster.autoscaling import QUEUED_TOKENS
from cluster.cache_report import cache_report
from cluster.app_config import AppConfig
from cluster.engine.async_engine import AsyncEngine
from cluster.engine.engine import LLMEngine
from cluster.kvtransfer.connectors import create_connector
from cluster.kvtransfer.handoff import PrefillHandoff, Receiver
from cluster.prefill.exporter import KVExporter, PackedKV
from cluster.sampling_params import SamplingParams


MAX_QUEUED_REPORTED = 512  # prompts whose remaining work a stats post lists (the shortest)


class PrefillServer:
    def __init__(self, config: AppConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        engine = engine or LLMEngine(config.prefill_engine)
        if config.prefill_engine.scheduler.prefill_schedule == "ttft":
            engine.calibrate()  # what a step costs, fixed and per token, before the first burst
        kv = config.kv_transfer
        self.connector = create_connector(kv.connector, engine.kv_layout(), **kv.connector_options(role="prefill"))
        self.exporter = KVExporter(engine, self.connector, lease_s=kv.lease_s)
        self.engine = AsyncEngine(engine)
        self.name = ""  # this replica's id
        # request id → (prompt tokens, of which not cached on arrival; 0 once computed): from
        # arrival to hand-off
        self.queued: dict[str, tuple[int, int]] = {}
        self._reaper: asyncio.Task | None = None
        self.last_abort_at = 0.0  # wall time a cancelled request's blocks were last released

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      receiver: Receiver) -> PrefillHandoff:
        """Compute R's prompt, send its KV to `receiver`; R's blocks stay held until `ack`.
        Cancelling this (the decode side went away) stops R before its next step and frees
        whatever it holds."""
        self._ensure_reaper()
        prompt = list(prompt_token_ids)
        cached = self.engine.cached_prefix_len(prompt, params.cache_salt) if self.config.prefix_aware_routing else 0
        self.queued[request_id] = (len(prompt), len(prompt) - cached)
        arrived = time.monotonic()
        stream = self.engine.open(request_id)
        cancelled = False
        try:
            # R's KV is packed on the engine thread right after the step that computed its
            # prompt's end: not a command queued behind the next step
            await self.engine.add_request(request_id, prompt, params, prefill_only=True,
                                          on_finish=functools.partial(self.exporter.pack, receiver=receiver))
            async for _ in stream:  # one output: the first token, once the prompt is computed
                pass
            self.queued[request_id] = (len(prompt), 0)  # its KV on the way: no work left here
            packed = stream.outcome
            assert packed is not None
            if not isinstance(packed, PrefillHandoff):
                handoff = await self._send(packed, receiver)
            else:  # the first token ended R: nothing to send
                handoff = packed
            return dataclasses.replace(handoff, prefill_s=time.monotonic() - arrived)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self.queued.pop(request_id, None)
            # its own task: a caller that cancels us again while we wait must not cut it short
            closing = asyncio.ensure_future(self._close(request_id, cancelled))
            await asyncio.shield(closing)

    async def _send(self, packed: PackedKV, receiver: Receiver) -> PrefillHandoff:
        """Send off the engine thread (the next steps go on meanwhile); then R's lease starts."""
        rid = packed.result.request_id
        sending = asyncio.ensure_future(asyncio.to_thread(self.exporter.send, packed, receiver))
        try:
            handoff = await asyncio.shield(sending)
        except asyncio.CancelledError:  # R's blocks stay held until its transfer has ended
            await asyncio.wait([sending])
            raise
        except BaseException:
            await self.engine.call(self.exporter.fail, rid)
            raise
        # queued, not awaited: the lease runs before any later command (the decode side's ack
        # comes after this hand-off), and the hand-off need not wait out the step in progress
        self.engine.submit(self.exporter.lease, rid, handoff.receipt)
        return handoff

    async def _close(self, request_id: str, cancelled: bool) -> None:
        await self.engine.close_stream(request_id)  # aborts R if its prompt was not computed yet
        if cancelled:  # and whatever R still holds (blocks for the hand-off, a lease) goes now
            await self.engine.call(self.exporter.drop, request_id)
            self.last_abort_at = time.time()

    async def ack(self, request_id: str) -> bool:
        return await self.engine.call(self.exporter.ack, request_id)

    async def stats(self) -> dict[str, Any]:
        base = await self.engine.call(self.exporter.stats)
        queued, started = self.work_left()
        return {**base, "queued_prompt_tokens": sum(n for n, _ in self.queued.values()),
                "queued_work": sorted(w for w in queued.values() if w)[:MAX_QUEUED_REPORTED],
                "running_work": sorted(started.values()),
                "engine_alive": self.engine.alive, "steps": self.engine.steps,
                "last_abort_at": self.last_abort_at, "histograms": self.connector.histograms()}

    def routing_stats(self) -> dict[str, Any]:
        """What the prefill pool's router ranks by (router/request_routers.py): the prompts queued
        here ([request id, its tokens to compute]) and what the prefix cache holds."""
        cache = cache_report(self.engine.blocks) if self.config.prefix_aware_routing else {}
        queued, started = self.work_left()
        return {"queued": [[rid, work] for rid, work in {**queued, **started}.items()], **cache}

    def work_left(self) -> tuple[dict[str, int], dict[str, int]]:
        """(queued, started): each prompt's tokens still to compute here, from arrival until its
        KV is sent, apart for those part way through their chunks (under fcfs they run to their
        end first; under ttft a shorter prompt passes them between chunks: decode/placement.py):
        what the engine has left of it, or all it did not find cached before it got there."""
        waiting, started = self.engine.prompt_work()
        queued, running = {}, {}
        for rid, (_, uncached) in list(self.queued.items()):
            if rid in started:
                running[rid] = min(started[rid], uncached)
            else:
                queued[rid] = min(waiting.get(rid, uncached), uncached)
        return queued, running

    def autoscaling_stats(self) -> dict[str, float]:
        """The load PrefillAutoscaling reads (cluster/autoscaling.py)."""
        return {QUEUED_TOKENS: sum(work for _, work in list(self.queued.values()))}

    def check_health(self) -> None:
        """Raise if the engine's step loop has exited or not turned for `stall_timeout_s`."""
        self.engine.check_health(self.config.stall_timeout_s)

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        period = max(0.05, min(1.0, self.config.kv_transfer.lease_s / 4))
        while True:
            await asyncio.sleep(period)
            await self.engine.call(self.exporter.reap)

    def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        self.engine.shutdown()
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
