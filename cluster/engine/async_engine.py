"""An `LLMEngine` driven by one step-loop thread, for asyncio callers (the Serve replicas).

    asyncio caller                       engine thread
    --------------                       -------------
    await call(fn)  ── command ──▶       runs fn(engine) between two steps, returns its value
    async for outs in stream(R)  ◀──     step() outputs, coalesced per request: whatever R
                                         produced since the caller last looked, in one list

The engine itself is single-threaded: every mutation goes through `call`, so the scheduler
and block manager need no locks. A consumer that falls behind gets several tokens per item
instead of one item per token (Serve pays ~1 ms of CPU per streamed chunk). Closing a stream
before its request finished aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, TypeVar

from cluster.engine.engine import LLMEngine
from cluster.engine.outputs import RequestOutput

T = TypeVar("T")


class RequestStream:
    """Outputs of one request, filled by the engine thread, drained by one asyncio task."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: list[RequestOutput] = []
        self.error: BaseException | None = None
        self.finished = False
        self._ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:  # on the loop
        self.items.append(out)
        self.finished = self.finished or out.finished
        self._ready.set()

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


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.last_step_at = time.monotonic()  # the loop's heartbeat (idle or busy)
        self.steps = 0
        self._slow_until, self._step_pause_s = 0.0, 0.0  # fault injection (see `slow_steps`)
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], asyncio.Future,
                                                asyncio.AbstractEventLoop, bool]] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    # -- asyncio side ------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], T], deliver: bool = False) -> T:
        """Run `fn(engine)` on the engine thread between steps; its exception is re-raised here.

        `deliver`: a `RequestOutput` that fn returns also goes to its request's stream, from the
        engine thread, so it stays ahead of what the next steps produce (the caller resuming
        after the await would come after them)."""
        if self._stop.is_set():
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        self._commands.put((fn, fut, loop, deliver))
        self._wake.set()
        return await fut

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
            await asyncio.shield(self.call(lambda e: e.abort_request(request_id)))

    async def generate(self, request_id: str, add: Callable[[LLMEngine], Any]) -> AsyncIterator[list[RequestOutput]]:
        """Add R with `add(engine)` and stream its outputs until it finishes."""
        stream = self.open(request_id)
        try:
            await self.call(add)
            async for outs in stream:
                yield outs
        finally:
            await self.close_stream(request_id)

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

    def wedge(self) -> None:
        """Fault injection: block the step loop for good (tests of the health check)."""
        self._commands.put((lambda e: threading.Event().wait(), asyncio.get_running_loop().create_future(),
                            asyncio.get_running_loop(), False))
        self._wake.set()

    def slow_steps(self, pause_s: float, for_s: float) -> None:
        """Fault injection: pause `pause_s` after every step for the next `for_s` seconds, so a
        test's request is surely still running when its caller goes away."""
        self._step_pause_s = pause_s
        self._slow_until = time.monotonic() + for_s

    # -- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
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
            if self._slow_until and time.monotonic() < self._slow_until:
                self._wake.wait(self._step_pause_s)  # a command (an abort) cuts the pause short
                self._wake.clear()
        self._fail_all(RuntimeError("the engine shut down"))

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut, loop, deliver = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                result = fn(self.engine)
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, fut, None, exc)
            else:
                if deliver and isinstance(result, RequestOutput):
                    self._deliver([result])
                loop.call_soon_threadsafe(_settle, fut, result, None)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, pairs in by_loop.items():
            loop.call_soon_threadsafe(_put_all, pairs)

    def _fail_all(self, exc: BaseException) -> None:
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


def _put_all(pairs: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in pairs:
        stream.put(out)
