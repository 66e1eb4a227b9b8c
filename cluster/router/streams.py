"""Pieces every API surface (OpenAI HTTP, gRPC) streams with: deadlines, the merge of n
samples into one stream, and an SSE stream that can be closed before it is read."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator

from cluster.engine.outputs import TokenDelta
from cluster.router.errors import APIError


class SSEStream:
    """One streamed response's SSE lines. `aclose()` ends the request wherever it stands, even
    when nobody started iterating (a client gone before the body): the samples behind it are
    already running, and closing them is what aborts them in the pools."""

    def __init__(self, lines: AsyncIterator[str], source: AsyncIterator[Any]) -> None:
        self._lines, self._source = lines, source

    def __aiter__(self) -> "SSEStream":
        return self

    async def __anext__(self) -> str:
        return await self._lines.__anext__()

    async def aclose(self) -> None:
        try:
            await self._lines.aclose()
        finally:
            await self._source.aclose()


def deadline_after(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


async def within(awaitable: Any, deadline: float | None) -> Any:
    """Await it before the deadline, or cancel it (which aborts the requests behind it) and 408."""
    if deadline is None:
        return await awaitable
    # Whose timeout it was is asked of the timer itself, never of a clock: uvloop (Serve's loop)
    # fires timers off a cached, millisecond clock, up to ~1 ms before time.monotonic() reaches
    # the deadline, and such a 408 used to come out as a 500.
    timer = asyncio.timeout(max(0.0, deadline - time.monotonic()))
    try:
        async with timer:
            return await awaitable
    except TimeoutError:
        if not timer.expired():  # a timeout from inside, not our deadline
            raise
        raise APIError(408, "the request's deadline passed before it completed", type_="timeout_error",
                       code="request_timeout") from None


def merge_samples(streams: list[AsyncIterator[list[TokenDelta]]],
                  read_ahead: bool = True) -> AsyncIterator[tuple[int, TokenDelta]]:
    """Interleave n children's deltas as (choice index, delta); cancels them all when closed.

    Whatever arrived since the reader last looked goes out at once, one delta per choice with its
    tokens concatenated (TokenDelta.concat): a reader that falls behind (its chunks cost more
    than a decode step) sends fewer, fuller chunks, and never waits for a token to send one.
    An error from a child comes out after the tokens that arrived before it.

    `read_ahead=False`: each read of a child already takes all that arrived since the last (the
    router's multiplexed buffers, router/mux.py), so one child is read directly, without a task
    reading ahead for it: one task switch less per token (the router's hot path)."""
    if len(streams) == 1 and not read_ahead:
        return _Single(streams[0])
    return _interleaved(streams)


async def _interleaved(streams: list[AsyncIterator[list[TokenDelta]]]) -> AsyncIterator[tuple[int, TokenDelta]]:
    arrived: list[tuple[int, TokenDelta | BaseException | None]] = []  # None: child j ended
    ready = asyncio.Event()

    async def pump(j: int, s: AsyncIterator[list[TokenDelta]]) -> None:
        try:
            async for deltas in s:
                arrived.extend((j, d) for d in deltas)
                ready.set()
            arrived.append((j, None))
        except BaseException as exc:
            arrived.append((j, exc))
            raise
        finally:
            ready.set()

    tasks = [asyncio.ensure_future(pump(j, s)) for j, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            await ready.wait()
            ready.clear()
            batch = arrived[:]
            del arrived[:]
            per_choice: dict[int, list[TokenDelta]] = {}
            for j, item in batch:
                if isinstance(item, TokenDelta):
                    per_choice.setdefault(j, []).append(item)
                    continue
                for k, ds in per_choice.items():  # what came before the end or the error first
                    yield k, TokenDelta.concat(ds)
                per_choice.clear()
                if item is None:
                    remaining -= 1
                else:
                    raise item
            for k, ds in per_choice.items():
                yield k, TokenDelta.concat(ds)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await _aclose(s)


class _Single:
    """One child read directly: each read takes what its buffer holds, as one delta."""

    def __init__(self, stream: AsyncIterator[list[TokenDelta]]) -> None:
        self.stream = stream

    def __aiter__(self) -> "_Single":
        return self

    async def __anext__(self) -> tuple[int, TokenDelta]:
        return 0, TokenDelta.concat(await self.stream.__anext__())

    async def aclose(self) -> None:
        await _aclose(self.stream)


async def _aclose(stream: AsyncIterator[Any]) -> None:
    """Close a child stream (which aborts its request), if it can be closed."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
