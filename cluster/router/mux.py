"""The router's side of the multiplexed token streams (decode/channels.py): one subscription per
decode replica carrying every step's deltas of this router's requests there, spread into one
buffer per request. Plain object: the Serve calls are injected.

    stream(R, own)   own = R's generate call (mux=this router): its first item, StreamStart,
                     names R's decode replica (subscribed to on first sight) and R's path;
                     R's deltas come from the channel or from `own`, never both, and each read
                     takes all that arrived since the last one (several steps when behind)
    closing stream(R) before R's last token closes `own` and, for R on a channel, calls `cancel`
                     on its replica (Serve notices a cancel only on a stream's next write, and
                     R's own stream has none): R is aborted there, by a task of its own that no
                     repeated cancellation of the closing caller cuts short. After R's last
                     token, `own` ends by itself
    a subscription that ends fails the requests on it with ChannelClosed (the router migrates
    them like requests of a lost replica); `own` failing fails R whatever its path
    reopen()         before a request is sent, when no channel is open (every one closed while
                     idle: a pause): subscribe again to the replicas that took this router's
                     requests within RECENT_S, so a burst after a pause finds its channel there
                     (or on its way) instead of waiting for its first request's StreamStart.
                     A replica says a subscription opened with an empty first batch; one that
                     ends without it (the replica is gone: Serve sent the call to another,
                     which refused it) is forgotten until a StreamStart names it again
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from typing import Any, AsyncIterator, Awaitable, Callable

from cluster.engine.outputs import ChannelClosed, StreamStart, TokenDelta
from cluster.router.migration import stop_stream

Batch = dict[str, list[TokenDelta]]
RECENT_S = 60.0  # a decode replica used this recently is subscribed to again after a pause


class _Buffer:
    def __init__(self) -> None:
        self.deltas: list[TokenDelta] = []
        self.via: str | None = None  # the replica whose channel carries R
        self.finished = False
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, deltas: list[TokenDelta]) -> None:
        self.deltas.extend(deltas)
        self.finished = self.finished or any(d.finish_reason is not None for d in deltas)
        self.ready.set()

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.ready.set()


class Mux:
    def __init__(self, subscribe: Callable[[str], AsyncIterator[Batch]],
                 cancel: Callable[[str, str], Awaitable[Any]], counters: Counter | None = None) -> None:
        self.subscribe = subscribe  # decode replica id → its stream of batches for this router
        self.cancel = cancel  # (decode replica id, request id) → abort R there
        self.counters: Counter[str] = Counter() if counters is None else counters  # streams_{multiplexed,own}
        self.channels: dict[str, asyncio.Task] = {}
        self.recent: dict[str, float] = {}  # decode replica → when a request here last started there
        self.waiting: dict[str, _Buffer] = {}  # request id → its buffer
        self._draining: set[asyncio.Task] = set()  # finished requests' own streams, ending

    def reopen(self) -> None:
        """After a pause (no channel open), subscribe again to the replicas used within RECENT_S."""
        if self.channels:
            return
        now = time.monotonic()
        for replica, seen in list(self.recent.items()):
            if now - seen > RECENT_S:
                del self.recent[replica]
            else:
                self._open(replica)

    async def stream(self, request_id: str, own: Any) -> AsyncIterator[list[TokenDelta]]:
        buf = self.waiting[request_id] = _Buffer()
        reader = asyncio.ensure_future(self._read_own(own, buf))
        try:
            while True:
                await buf.ready.wait()
                buf.ready.clear()
                deltas, buf.deltas = buf.deltas, []
                if deltas:
                    yield deltas
                if buf.finished:
                    return
                if buf.error is not None:
                    raise buf.error
        finally:
            if self.waiting.get(request_id) is buf:
                del self.waiting[request_id]
            if buf.finished and buf.error is None:  # R is done: its own stream ends by itself
                self._background(reader)
            else:  # the client went away, or R failed: abort R wherever it is, in a task of its
                # own and without awaiting here: a client's hang-up reaches us as a cancellation
                # that anyio's cancel scope (Starlette's streaming response) delivers again at
                # every await until we return, which would cut an abort awaited here short
                reader.cancel()
                self._background(self._abort(request_id, buf, reader, own))

    async def _abort(self, request_id: str, buf: _Buffer, reader: asyncio.Future, own: Any) -> None:
        try:
            await asyncio.gather(reader, return_exceptions=True)  # R's path is known once it ends
            await stop_stream(own)
        finally:
            if buf.via is not None:  # a cancel of `own` reaches nobody: Serve would see it on a write
                with contextlib.suppress(Exception):  # (a replica gone has nothing left to abort)
                    await self.cancel(buf.via, request_id)

    def _background(self, call: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(call)
        self._draining.add(task)
        task.add_done_callback(self._draining.discard)

    async def _read_own(self, own: Any, buf: _Buffer) -> None:
        try:
            async for item in own:
                if isinstance(item, StreamStart):
                    self._start(item, buf)
                else:
                    buf.put(item)
        except Exception as exc:
            buf.fail(exc)
            return
        if buf.via is None and not buf.finished:
            buf.fail(RuntimeError("the decode stream ended before its last token"))

    def _start(self, start: StreamStart, buf: _Buffer) -> None:
        self.recent[start.replica] = time.monotonic()
        live = start.replica in self.channels
        if not live:
            self._open(start.replica)
        self.counters["streams_multiplexed" if start.multiplexed else "streams_own"] += 1
        if start.multiplexed:
            buf.via = start.replica
            if not live:  # the replica has a channel of ours we no longer read
                buf.fail(ChannelClosed(f"no open channel to decode replica {start.replica}"))

    def _open(self, replica: str) -> None:
        """Subscribe to `replica`: the call goes out now (ahead of a request about to be sent
        there), its batches read by a task."""
        self.channels[replica] = asyncio.ensure_future(self._pump(replica, self.subscribe(replica)))

    async def _pump(self, replica: str, batches: AsyncIterator[Batch]) -> None:
        opened = False
        try:
            async for batch in batches:
                opened = True
                for rid, deltas in batch.items():
                    buf = self.waiting.get(rid)
                    if buf is not None:
                        buf.put(deltas)
        except Exception:
            pass
        finally:
            del self.channels[replica]
            if not opened:  # not there: wait for a StreamStart to name it again
                self.recent.pop(replica, None)
            for buf in self.waiting.values():
                if buf.via == replica and not buf.finished:
                    buf.fail(ChannelClosed(f"the channel to decode replica {replica} closed"))

    async def close(self) -> None:
        tasks = list(self.channels.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

