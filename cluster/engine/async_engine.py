"""An `LLMEngine` driven by one step-loop thread, for asyncio callers (the Serve replicas).

    asyncio caller                          engine thread
    --------------                          -------------
    await add_request(R, ...)  ── command ──▶  runs LLMEngine.add_request between two steps
    await call(importer.reserve, R, ...)    runs any named callable there, returns its value
    async for outs in open(R)  ◀──          step() outputs, coalesced per request: whatever R
                                            produced since the caller last looked, in one list

The engine itself is single-threaded: every mutation goes through a command, so the scheduler
and block manager need no locks. The servers never touch the `LLMEngine` themselves: they ask
this class (`cached_prefix_len`, `load`, ...), whose queries read plain values from the loop's
thread (a snapshot may fall mid-step; that is all a routing or admission estimate needs). A consumer that falls behind gets several tokens per item
instead of one item per token (Serve pays ~1 ms of CPU per streamed chunk). Closing a stream
before its request finished aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, NamedTuple, Sequence, TypeVar

from cluster.engine.block_manager import BlockManager
from cluster.engine.engine import LLMEngine
from cluster.engine.outputs import RequestOutput
from cluster.sampling_params import SamplingParams

T = TypeVar("T")


class RequestStream:
    """Outputs of one request, filled by the engine thread, drained by one asyncio task."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[RequestOutput] = []
        self.error: BaseException | None = None
        self.finished = False
        self.outcome: Any = None  # what add_request's `on_finish` returned for R's last output
        self.sink: Callable[[RequestOutput], None] | None = None  # see `divert`
        self._ready = asyncio.Event()

    def divert(self, sink: Callable[[RequestOutput], None]) -> list[RequestOutput]:
        """Hand each output to `sink` from now on, called on the loop as it arrives, instead of
        queueing it for a task that iterates the stream: no task switch per token (a decode
        replica's multiplexed path, where a step's outputs go into one channel). Returns what was
        queued before (hand it on first: it comes before anything the sink sees); then await
        `done()`. A sink that raises fails the stream with its error."""
        self.sink = sink
        queued, self.items = self.items, []
        return queued

    def put(self, out: RequestOutput, outcome: Any = None) -> None:  # on the loop
        if outcome is not None:
            self.outcome = outcome
        self.finished = self.finished or out.finished
        if self.sink is None:
            self.items.append(out)
            self._ready.set()
        elif self.error is None:
            try:
                self.sink(out)
            except BaseException as exc:
                self.fail(exc)
            else:
                if out.finished:
                    self._ready.set()

    async def done(self) -> None:
        """(A diverted stream) return once R finished; raise what failed it."""
        while not self.finished and self.error is None:
            await self._ready.wait()
            self._ready.clear()
        if self.error is not None:
            raise self.error

    def fail(self, exc: BaseException) -> None:  # on the loop
        self.error = exc
        self._ready.set()

    async def __aiter__(self) -> AsyncIterator[list[RequestOutput]]:
        while True:
            await self._ready.wait()
            self._ready.clear()
            items, self.items = self.items, []
            if items:
                yield items
            if self.error is not None:
                raise self.error
            if items and items[-1].finished:
                return


class EngineLoad(NamedTuple):
    """What a replica's router and autoscaler read of its engine (a snapshot)."""

    num_running: int
    num_waiting: int  # queued for a step, or for their remote KV
    waiting_tokens: int  # prompt tokens still to compute: the queued ones' (not those awaiting KV)
    #                      and the rest of any prompt being computed in chunks
    free_blocks: int
    used_blocks: int
    num_blocks: int


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine  # owned by the engine thread: reach it through commands
        self.idle_wait_s = idle_wait_s
        self.last_step_at = time.monotonic()  # the loop's heartbeat (idle or busy)
        self.steps = 0
        self._commands: queue.SimpleQueue[tuple[Callable[..., Any], tuple, asyncio.Future,
                                                asyncio.AbstractEventLoop, bool]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._on_finish: dict[str, Callable[[RequestOutput], Any]] = {}  # engine thread only
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    # -- asyncio side ------------------------------------------------------------------
    async def call(self, fn: Callable[..., T], *args: Any, deliver: bool = False) -> T:
        """Run `fn(*args)` on the engine thread between steps; its exception is re-raised here.
        `fn` is a named method of the engine or of an object driving it (KVImporter, KVExporter).

        `deliver`: a `RequestOutput` that fn returns also goes to its request's stream, from the
        engine thread, so it stays ahead of what the next steps produce (the caller resuming
        after the await would come after them)."""
        return await self.submit(fn, *args, deliver=deliver)

    def submit(self, fn: Callable[..., T], *args: Any, deliver: bool = False) -> asyncio.Future:
        """`call` without waiting: fn(*args) is queued now, and runs after every command queued
        before it and before every one queued after it; the future settles with its result."""
        if self._stop.is_set():
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._commands.put((fn, args, fut, loop, deliver))
        self._wake.set()
        return fut

    async def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                          prefill_only: bool = False,
                          on_finish: Callable[[RequestOutput], Any] | None = None) -> None:
        """R joins the engine's queue (open its stream first). `prefill_only`: R finishes once its
        prompt is computed and its first token sampled, its blocks held for the hand-off.
        `on_finish(out)` runs on the engine thread right after the step that finished R, before
        the next one (a prefill replica packs R's KV there); what it returns is the stream's
        `outcome`, and what it raises fails the stream."""
        await self.call(self._add, request_id, list(prompt_token_ids), params, prefill_only, on_finish)

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams, prefill_only: bool,
             on_finish: Callable[[RequestOutput], Any] | None) -> None:
        self.engine.add_request(request_id, prompt, params, prefill_only)
        if on_finish is not None:
            self._on_finish[request_id] = on_finish

    async def abort(self, request_id: str) -> bool:
        """Stop R wherever it is (queued, running, or holding blocks for a hand-off); free its blocks."""
        return await self.call(self._abort, request_id)

    def _abort(self, request_id: str) -> bool:
        self._on_finish.pop(request_id, None)
        return self.engine.abort_request(request_id)

    async def stats(self) -> dict[str, Any]:
        return await self.call(self.engine.stats)

    # -- queries, from the loop's thread (snapshots) ---------------------------------------
    @property
    def blocks(self) -> BlockManager:
        """The block manager, for read-only reports (its prefix cache: cluster/cache_report.py)."""
        return self.engine.blocks

    @property
    def block_size(self) -> int:
        return self.engine.blocks.block_size

    @property
    def prefix_caching(self) -> bool:
        return self.engine.blocks.enable_prefix_caching

    def cached_prefix_len(self, prompt_token_ids: list[int], salt: str | None) -> int:
        """Tokens of this prompt the prefix cache would serve now."""
        return self.engine.blocks.cached_prefix_len(prompt_token_ids, salt)

    def step_costs(self) -> tuple[float, float, float, float] | None:
        """(fixed, per_token) seconds of this engine's steps as fitted so far, and what 9 steps in
        10 ran over the fit lately (StepCost.tail, a factor; StepCost.stall_s); None until known."""
        cost = self.engine.step_cost
        fixed, per_token = cost.fixed_s, cost.per_token_s
        return None if fixed is None or per_token is None else (fixed, per_token, cost.tail, cost.stall_s)

    def extra_step_seconds(self, num_tokens: int) -> float | None:
        """What `num_tokens` more tokens would add to a step (this engine's measured cost per
        token); None until it is known."""
        return self.engine.step_cost.extra_seconds(num_tokens)

    def load(self) -> EngineLoad:
        e = self.engine
        s = e.scheduler
        waiting_tokens = sum(r.num_tokens - r.num_computed_tokens for r in list(s.waiting))
        waiting_tokens += sum(left for r in list(s.running) if (left := r.num_tokens - r.num_computed_tokens) > 1)
        return EngineLoad(len(s.running), len(s.waiting) + len(s.remote), waiting_tokens, e.blocks.num_free_blocks,
                          e.blocks.num_used_blocks, e.blocks.num_blocks)

    def prompt_work(self) -> tuple[dict[str, int], dict[str, int]]:
        """(queued, started): request id → prompt tokens still to compute, of the requests queued
        here and of those part way through their prompt (a snapshot, as `load`)."""
        s = self.engine.scheduler
        queued = {r.request_id: r.num_tokens - r.num_computed_tokens for r in list(s.waiting)}
        started = {r.request_id: left for r in list(s.running) if (left := r.num_tokens - r.num_computed_tokens) > 1}
        return queued, started

    def open(self, request_id: str) -> RequestStream:
        """Register R's stream before R enters the engine, so no output is missed."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        return stream

    async def close_stream(self, request_id: str) -> None:
        """Forget R's stream; abort R if it has not finished (the caller went away)."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and not stream.finished:
            await asyncio.shield(self.abort(request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def check_health(self, stall_timeout_s: float) -> None:
        """Raise if the step loop has exited, or has not turned for `stall_timeout_s` (it turns
        every `idle_wait_s` when idle, after every step when busy): a wedged engine."""
        if not self.alive:
            raise RuntimeError("the engine's step loop has exited")
        stalled = time.monotonic() - self.last_step_at
        if stalled > stall_timeout_s:
            raise RuntimeError(f"the engine's step loop has not turned for {stalled:.1f} s: wedged")

    # -- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        _name_os_thread("tandem-engine")
        engine = self.engine
        while not self._stop.is_set():
            self._run_commands()
            self.last_step_at = time.monotonic()
            if not engine.has_unfinished_requests():
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            try:
                outs = engine.step()
            except Exception as exc:  # a bug or a device error: fail what is running, keep the loop
                self._fail_all(exc)
                continue
            self.steps += 1
            self._deliver(outs)
        self._fail_all(RuntimeError("the engine shut down"))

    def _run_commands(self) -> None:
        while True:
            try:
                fn, args, fut, loop, deliver = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(*args)
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                if deliver and isinstance(result, RequestOutput):
                    self._deliver([result])
                loop.call_soon_threadsafe(_settle, fut, result, None)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput, Any, BaseException | None]]] = {}
        for out in outs:
            hook = self._on_finish.pop(out.request_id, None) if out.finished else None
            outcome, error = None, None
            if hook is not None:
                try:
                    outcome = hook(out)
                except BaseException as exc:  # the stream fails with it; R's owner cleans up
                    error = exc
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out, outcome, error))
        for loop, entries in by_loop.items():
            loop.call_soon_threadsafe(_put_all, entries)

    def _fail_all(self, exc: BaseException) -> None:
        self._on_finish.clear()
        for rid, stream in list(self._streams.items()):
            if not stream.finished:
                self.engine.abort_request(rid)
                stream.loop.call_soon_threadsafe(stream.fail, exc)


def _settle(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _put_all(entries: list[tuple[RequestStream, RequestOutput, Any, BaseException | None]]) -> None:
    for stream, out, outcome, error in entries:
        if error is not None:
            stream.fail(error)
        else:
            stream.put(out, outcome)


def _name_os_thread(name: str) -> None:
    """The calling thread's name as the OS shows it (`top -H`, /proc/PID/task/TID/comm; 15
    bytes), so the engine thread's CPU can be told from the event loop's; Linux only."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # no prctl (not Linux): the thread keeps its process's name
        pass
