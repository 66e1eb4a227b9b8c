"""A decode replica as a plain asyncio object: continuous batching on one engine thread,
requests arriving either with a prompt to prefill here (colocated) or with their prompt's
KV coming from a prefill replica (disaggregated).

    generate(R, prompt, params, prefill)
      colocated (prefill is None), or at most `max_local_prefill_tokens` of R's prompt not cached
      here, or computing those here adds at most `local_prefill_budget_ms` to a step (this
      replica's measured cost per token): R joins the engine's queue like any request
      disaggregated:
        1. reserve R's destination blocks; expect R on the connector  (no room → prefill here);
           the blocks of R's prefix already cached here are shared, and not sent. The same
           prompt already on its way here (n samples, a burst of one prompt): wait for it to
           land first, so its KV crosses once and its blocks are held once
        2. await prefill.prefill(R, ..., receiver)  → first token, KV pushed/put by prefill
           (a prefill replica lost before answering: retried on another, PREFILL_RETRIES times)
        3. fetch + verify the KV off the engine thread; import it; R joins the running batch
           (a transfer error takes kv_load_failure_policy: recompute here, or fail R)
        4. ack the prefill replica (it frees R's blocks), then stream R's tokens
    Closing the stream early (client gone) aborts R and frees its blocks; the prefill side is
    cancelled too, or acked at once if it already handed R over.

The Serve deployment (cluster/decode/deployment.py) is a thin shell over this class.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import Any, AsyncIterator, Sequence

from cluster.autoscaling import BLOCKS_IN_USE, NUM_BLOCKS, REQUESTS
from cluster.app_config import AppConfig
from cluster.decode.channels import Channel, Channels
from cluster.decode.importer import KVImporter
from cluster.decode.placement import PlacementInputs, PrefillPoolView, StepCosts, place
from cluster.engine.async_engine import AsyncEngine, RequestStream
from cluster.engine.engine import LLMEngine
from cluster.kvtransfer.connectors import create_connector
from cluster.kvtransfer.errors import KVTransferError
from cluster.kvtransfer.handoff import PrefillClient, PrefillFailed, PrefillHandoff, prefill_with_retries
from cluster.metrics import ITL_BUCKETS, Histogram
from cluster.engine.outputs import RequestOutput, StreamStart, TokenDelta
from cluster.cache_report import cache_report
from cluster.sampling_params import SamplingParams


PREFILL_POOL_KEYS = ("queued_work", "running_work", "step_fixed_s", "step_s_per_token", "max_num_batched_tokens",
                     "posted_at")
REPORT_LAG_S = 0.1  # a prompt sent this long before a report was collected is in it (a handle call's time)
HANDOFF_EWMA = 0.2
POOL_VIEW_STALE_S = 5.0  # a prefill pool view this old (its watcher failing) is not used


class DecodeServer:
    def __init__(self, config: AppConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        engine = engine or LLMEngine(config.engine)
        self.connector = None
        self.importer: KVImporter | None = None
        if config.mode == "disaggregated":
            kv = config.kv_transfer
            self.connector = create_connector(kv.connector, engine.kv_layout(), **kv.connector_options("decode"))
            self.importer = KVImporter(engine, self.connector, kv.kv_load_failure_policy, kv.timeout_s)
            if config.local_prefill_budget_ms or config.ttft_slo_ms or config.itl_slo_ms:  # know what a
                # token costs before the first request
                engine.calibrate()
        self._max_step_s = engine.config.scheduler.max_step_ms / 1e3  # its steps' cap while streams decode
        self._prompt_chunk = engine.config.scheduler.prompt_chunk  # one prompt's tokens in a step at most
        pool = config.prefill_engine.scheduler  # how the prefill pool chunks and orders prompts
        self._pool_chunk, self._pool_passes = pool.prompt_chunk, pool.prefill_schedule == "ttft"
        self.engine = AsyncEngine(engine)
        self.channels = Channels()  # the routers' multiplexed token streams
        self.name = ""  # this replica's id, in traces
        self.itl = Histogram(ITL_BUCKETS)  # seconds between a request's tokens, engine clock
        self.counters: Counter[str] = Counter()
        self.last_abort_at = 0.0  # wall time an abandoned request's blocks were last freed
        self._acks: set[asyncio.Task] = set()
        self._landing: dict[tuple, asyncio.Event] = {}  # (prompt, salt) → set once its KV landed here
        self._prefill_pool: PrefillPoolView | None = None  # as its replicas last posted (placement by SLO)
        # prompts sent there and not back yet, request id → (wall time, tokens): until a report
        # collected after they were sent shows them, or their prefill returns
        self._sent_since_report: dict[str, tuple[float, int]] = {}
        self._pool_seen_at = 0.0
        self._placing_here: dict[str, int] = {}  # placed here, not yet in the engine's queue: their tokens
        self._handoff_s = 0.01  # what a hand-off costs beyond the pool's queue and compute, lately (EWMA), s

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       prefill: PrefillClient | None = None,
                       mux: str | None = None) -> AsyncIterator[list[TokenDelta] | StreamStart]:
        """R's token deltas; the last one carries R's trace (where and how long each part took).
        `mux`: the calling router replica's id; R's deltas then go over its channel when it has
        one open here (decode/channels.py), after a first item that says so."""
        prompt = list(prompt_token_ids)
        stream = self.engine.open(request_id)
        trace: dict[str, Any] = {"decode_replica": self.name}
        channel, coming = self.channels.claim(mux) if mux is not None else (None, False)
        # its router's subscription on its way (a burst after a pause): R starts now, and says
        # where its deltas go once the channel opens (or the wait for it ends)
        opening = asyncio.ensure_future(self.channels.opened(mux)) if coming else None
        clock: list[float | None] = [None]  # R's last token's engine time
        try:
            if channel is not None:
                self._onto(channel, request_id, stream, trace, clock)
            if mux is not None and opening is None:
                yield StreamStart(self.name, channel is not None)
            if prefill is None or self.importer is None or self._prefill_here(request_id, prompt, params, trace):
                try:
                    await self.engine.add_request(request_id, prompt, params)
                finally:  # in the engine's queue now, where placement sees it
                    self._placing_here.pop(request_id, None)
            else:
                await self._remote_prefill(request_id, prompt, params, prefill, trace)
            if opening is not None:
                channel = await opening
                if channel is not None:
                    self._onto(channel, request_id, stream, trace, clock)
                yield StreamStart(self.name, channel is not None)
            if channel is None:
                async for outs in stream:
                    yield [self._delta(outs, trace, clock)]
            else:
                await stream.done()
        finally:
            if opening is not None:
                opening.cancel()
            if channel is not None:
                channel.detach(request_id)
            if self.connector is not None:
                self.connector.cancel(request_id)
            # Closing runs as its own task: a caller that cancels us again while we wait must not
            # cut it short, nor the bookkeeping after it.
            closing = asyncio.ensure_future(self.engine.close_stream(request_id))
            if not stream.finished:  # the caller went away: R is aborted and its blocks freed
                closing.add_done_callback(self._aborted)
            await asyncio.shield(closing)

    def _onto(self, channel: Channel, request_id: str, stream: RequestStream, trace: dict[str, Any],
              clock: list[float | None]) -> None:
        """R's outputs go into the router's channel from now on as the loop receives them, those
        R queued before first, as one delta; Channels.cancel aborts R through it."""
        channel.attach(request_id, asyncio.current_task())
        queued = stream.divert(lambda out: channel.put(request_id, self._delta([out], trace, clock)))
        if queued:
            channel.put(request_id, self._delta(queued, trace, clock))

    def _delta(self, outs: list[RequestOutput], trace: dict[str, Any], clock: list[float | None]) -> TokenDelta:
        """R's outputs since the last delta as one; the last carries R's trace."""
        for out in outs:  # engine timestamps: one token per step per request
            if clock[0] is not None:
                self.itl.observe(out.time - clock[0])
            clock[0] = out.time
        delta = TokenDelta.merge(outs)
        if delta.finish_reason is not None:
            delta.trace = {**trace, "decode_queue_s": outs[-1].queue_s}
            if outs[-1].num_draft_tokens:
                delta.trace.update(spec_draft_tokens=outs[-1].num_draft_tokens,
                                   spec_accepted_tokens=outs[-1].num_accepted_tokens)
        return delta

    def _aborted(self, _: asyncio.Future) -> None:
        self.counters["aborted"] += 1
        self.last_abort_at = time.time()

    def _prefill_here(self, rid: str, prompt: list[int], params: SamplingParams, trace: dict[str, Any]) -> bool:
        """Conditional disaggregation: few tokens to compute (those this replica's prefix cache
        does not hold) cost less here than a trip through the prefill pool and the connector.
        Few: at most `max_local_prefill_tokens`, or, by time, computing them adds at most
        `local_prefill_budget_ms` to the step the running streams wait on. Past those limits, with
        SLOs set (`ttft_slo_ms`, `itl_slo_ms`), wherever the estimates keep them (decode/placement.py);
        the decision and its inputs go in R's trace."""
        limit, budget_ms = self.config.max_local_prefill_tokens, self.config.local_prefill_budget_ms
        if not (limit or budget_ms or self.places_by_slo):
            return False
        uncached = len(prompt)  # a prompt to score is computed whole, cache or not
        if params.prompt_logprobs is None:
            uncached -= self.engine.cached_prefix_len(prompt, params.cache_salt)
        if limit and uncached <= limit:
            self.counters["prefilled_locally_short"] += 1
            trace["kv"] = f"short: prefilled here ({uncached} uncached tokens)"
            return True
        extra_s = self.engine.extra_step_seconds(uncached) if budget_ms else None
        if extra_s is not None and extra_s * 1e3 <= budget_ms:
            self.counters["prefilled_locally_budget"] += 1
            trace["kv"] = f"budget: prefilled here ({uncached} uncached tokens, ~{extra_s * 1e3:.0f} ms)"
            return True
        if not self.places_by_slo:
            return False
        inputs = self._placement_inputs(uncached)
        placement = place(inputs, self.config.ttft_slo_ms / 1e3, self.config.itl_slo_ms / 1e3)
        trace.update(placement.trace())
        if inputs.decode is not None:
            trace["step_tail"] = round(inputs.decode.tail, 3)
            trace["step_stall_ms"] = round(inputs.decode.stall_s * 1e3, 1)
        if placement.where == "remote":
            self._sent_since_report[rid] = (time.time(), uncached)
            return False
        self._placing_here[rid] = uncached  # until the engine's queue holds it: a burst sees its peers
        self.counters["prefilled_locally_slo"] += 1
        trace["kv"] = f"slo: prefilled here ({uncached} uncached tokens)"
        return True

    @property
    def places_by_slo(self) -> bool:
        return self.importer is not None and bool(self.config.ttft_slo_ms or self.config.itl_slo_ms)

    @property
    def has_seen_prefill_pool(self) -> bool:
        """Whether a post of the prefill pool has reached this replica since its start."""
        return self._pool_seen_at > 0

    def observe_prefill_pool(self, replicas: list[dict[str, Any]]) -> None:
        """The prefill pool's replicas as last posted (PREFILL_POOL_KEYS of each): their queues and
        step cost, for placement by SLO."""
        live = [r for r in replicas if r.get("step_fixed_s") is not None and r.get("step_s_per_token") is not None]
        if not live:
            self._prefill_pool = None
            return
        self._pool_seen_at = time.monotonic()
        fixed = max(r["step_fixed_s"] for r in live)  # the slowest replica's, to be safe
        per_token = max(r["step_s_per_token"] for r in live)
        queued = tuple(w for r in live for w in r.get("queued_work") or ())
        running = tuple(w for r in live for w in r.get("running_work") or ())
        self._prefill_pool = PrefillPoolView(StepCosts(fixed, per_token), queued, len(live),
                                             min(r.get("max_num_batched_tokens") or 512 for r in live), running,
                                             self._pool_chunk, self._pool_passes)
        # a report was collected a while before it reached here: the prompts sent since (or just
        # before, still on their way) are not in it
        collected = min((r.get("posted_at") or 0.0) for r in live) - REPORT_LAG_S
        self._sent_since_report = {rid: (t, n) for rid, (t, n) in list(self._sent_since_report.items()) if t > collected}

    def _placement_inputs(self, uncached: int) -> PlacementInputs:
        load = self.engine.load()
        costs = self.engine.step_costs()
        pool = self._prefill_pool if time.monotonic() - self._pool_seen_at <= POOL_VIEW_STALE_S else None
        if pool is not None and self._sent_since_report:  # sent there since the pool last posted
            pool = pool.plus_sent([n for _, n in self._sent_since_report.values()])
        waiting = load.waiting_tokens + sum(self._placing_here.values())
        return PlacementInputs(uncached, StepCosts(*costs) if costs else None, load.num_running, waiting,
                               self.config.engine.scheduler.max_num_batched_tokens, pool, self._handoff_s,
                               self._max_step_s, self._prompt_chunk,
                               coming=load.num_waiting + len(self._placing_here))

    async def _remote_prefill(self, rid: str, prompt: list[int], params: SamplingParams,
                              prefill: PrefillClient, trace: dict[str, Any]) -> None:
        importer = self.importer
        assert importer is not None
        key = (tuple(prompt), params.cache_salt)
        ahead = self._landing.get(key)
        if ahead is None:
            self._landing[key] = landed = asyncio.Event()
            try:
                await self._reserve_and_prefill(rid, prompt, params, prefill, trace)
            finally:
                landed.set()
                if self._landing.get(key) is landed:
                    del self._landing[key]
            return
        if self._shares_prefix(prompt, params):
            waiting = time.monotonic()
            self.counters["same_prompt_waits"] += 1
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ahead.wait(), self.config.kv_transfer.timeout_s)
            trace["same_prompt_wait_s"] = time.monotonic() - waiting
        await self._reserve_and_prefill(rid, prompt, params, prefill, trace)

    def _shares_prefix(self, prompt: list[int], params: SamplingParams) -> bool:
        """Whether R could take full blocks of its prompt from this replica's prefix cache."""
        return (self.engine.prefix_caching and params.prompt_logprobs is None
                and len(prompt) > self.engine.block_size)

    async def _reserve_and_prefill(self, rid: str, prompt: list[int], params: SamplingParams,
                                   prefill: PrefillClient, trace: dict[str, Any]) -> None:
        importer = self.importer
        assert importer is not None
        receiver = await self.engine.call(importer.reserve, rid, prompt, params)
        if receiver is None:  # no room for R's KV right now: queue it here, prefilled locally
            self._sent_since_report.pop(rid, None)
            self.counters["prefilled_locally_no_room"] += 1
            trace["kv"] = "no room: prefilled here"
            await self.engine.add_request(rid, prompt, params)
            return
        trace["kv_reused_tokens"] = receiver.cached_blocks * self.engine.block_size
        sent, retried = time.monotonic(), []

        def on_retry() -> None:
            retried.append(True)
            self._retried()
        try:
            handoff = await prefill_with_retries(prefill, rid, prompt, params, receiver, on_retry)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._sent_since_report.pop(rid, None)
            self.counters["prefill_failed"] += 1
            trace["kv"] = f"prefill failed ({type(exc).__name__}): {importer.policy}"
            await self.engine.call(importer.abandon, rid)
            if importer.policy == "fail":
                raise PrefillFailed(f"prefill failed: {type(exc).__name__}: {exc}") from exc
            return  # recomputed here from the prompt
        self._sent_since_report.pop(rid, None)  # computed there: no longer in the pool's way
        trace.update(prefill_replica=handoff.origin, prefill_s=handoff.prefill_s, kv_bytes=handoff.kv_bytes,
                     kv_send_s=handoff.kv_send_s, kv="ended at the first token" if handoff.finished else "landed")
        packed = error = None
        if not handoff.finished:
            fetching = time.monotonic()
            try:
                packed = await asyncio.to_thread(importer.fetch, rid, handoff)
            except KVTransferError as exc:
                error = exc
                trace["kv"] = f"{exc.kind}: {importer.policy}"
            finally:  # landed, failed or cancelled: the prefill side may free R's blocks now
                self._ack(prefill, handoff)
            trace["kv_receive_s"] = time.monotonic() - fetching
        if error is None and not retried:  # for placement by SLO: the calls both ways, the KV's send
            # and receive; all but the pool's queue and compute (prefill_s holds those and the send)
            handoff_s = time.monotonic() - sent - (handoff.prefill_s - handoff.kv_send_s)
            trace["handoff_s"] = handoff_s
            self._handoff_s += HANDOFF_EWMA * (handoff_s - self._handoff_s)
        # the first token goes to R's stream from the engine thread, ahead of the steps after it
        await self.engine.call(importer.start, rid, handoff, packed, error, deliver=True)

    def _retried(self) -> None:
        self.counters["prefill_retried"] += 1

    def _ack(self, prefill: PrefillClient, handoff: PrefillHandoff) -> None:
        task = asyncio.get_running_loop().create_task(prefill.ack(handoff))
        self._acks.add(task)
        task.add_done_callback(self._ack_done)

    def _ack_done(self, task: asyncio.Task) -> None:
        self._acks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.counters["ack_failed"] += 1  # the prefill side's lease frees the blocks

    def routing_stats(self) -> dict[str, Any]:
        """What the decode pool's router ranks by (router/request_routers.py), with what the prefix
        cache holds: colocated, it saves computing a prompt here; disaggregated, receiving its KV."""
        load = self.engine.load()
        cache = cache_report(self.engine.blocks) if self.config.prefix_aware_routing else {}
        return {"free_blocks": load.free_blocks, "num_running": load.num_running, "num_waiting": load.num_waiting,
                **cache}

    def autoscaling_stats(self) -> dict[str, float]:
        """The load DecodeAutoscaling reads (cluster/autoscaling.py)."""
        load = self.engine.load()
        return {REQUESTS: load.num_running + load.num_waiting, BLOCKS_IN_USE: load.used_blocks,
                NUM_BLOCKS: load.num_blocks}

    async def stats(self) -> dict[str, Any]:
        if self.importer is not None:
            base = await self.engine.call(self.importer.stats)
        else:
            base = await self.engine.stats()
        histograms = {"vllm:inter_token_latency_seconds": self.itl.to_dict(),
                      **(self.connector.histograms() if self.connector is not None else {})}
        return {**base, **self.counters, "engine_alive": self.engine.alive, "steps": self.engine.steps,
                "last_abort_at": self.last_abort_at, "histograms": histograms}

    def check_health(self) -> None:
        self.engine.check_health(self.config.stall_timeout_s)

    def close(self) -> None:
        self.engine.shutdown()
        if self.connector is not None:
            self.connector.close()
