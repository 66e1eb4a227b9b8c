"""A decode replica's multiplexed token streams: one stream per router replica carrying, per
decode step, every new delta of that router's requests (issue 32), instead of one message per
token per request.

    router replica ── subscribe(router) ─────────────▶ Channels.serve(router): batches
                   ── generate(R, ..., mux=router) ─▶ first item StreamStart(replica, multiplexed)
                                                      then R's deltas: into the router's channel
                                                      when it has one open here, else on R's own
                                                      stream as before (never both)

R's own stream stays open until R finishes, but carries nothing after its first item, and Serve
notices a caller's cancel of a stream only when it next writes to it: so the router aborts R by
a call (`cancel`, pinned to this replica), and a channel that closes (its router went away or
gave it up) cancels every request still on it.
A channel no request has used for IDLE_CLOSE_S ends its stream: the router opens it again when
it next sees a request here. A request that finds no channel goes on its own stream, and its
StreamStart tells the router to subscribe; the router's next requests within SUBSCRIBE_WAIT_S
expect that subscription (`Channels.claim`): each starts computing at once, its outputs queued,
and its StreamStart waits for the channel to open (`Channels.opened`), which then takes what it
queued and the rest. So a burst after a pause goes over one channel, not one stream per request,
and no first token waits for the subscription longer than it would have taken anyway (a
subscription that never comes: each goes on its own stream when the wait ends). A channel is a
request in flight to Serve, so one held open while idle would keep a replica being removed
(scale-down) from draining until Serve's graceful_shutdown_timeout_s (20 s by default) killed it.
A batch is {request id: [deltas]}, everything put since the subscriber last looked: the deltas
of one engine step arrive together (AsyncEngine hands a step's outputs to the loop at once),
so a router gets one message per step whatever the number of its streams. A channel that
closes (its router went away or gave it up) fails the requests still on it (ChannelClosed),
which the router migrates like a lost replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

from cluster.engine.outputs import ChannelClosed, TokenDelta

IDLE_CLOSE_S = 2.0
SUBSCRIBE_WAIT_S = 1.0  # how long after a request told its router to subscribe the next ones expect it
#                        (a burst of 64 on two cores: its subscription arrived 0.2-0.5 s after)


class Channel:
    def __init__(self, idle_close_s: float = IDLE_CLOSE_S) -> None:
        self.pending: dict[str, list[TokenDelta]] = {}
        self.closed = False
        self.tasks: dict[str, asyncio.Task] = {}  # request id → the task streaming it here
        self.idle_close_s = idle_close_s  # 0: never
        self._ready = asyncio.Event()
        self._idle = False  # set by the timer: no request on the channel for idle_close_s
        self._timer: asyncio.TimerHandle | None = None  # running while no request is on it

    def attach(self, request_id: str, task: asyncio.Task) -> None:
        """R streams here; `task` runs R (Channels.cancel cancels it)."""
        self.tasks[request_id] = task
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def detach(self, request_id: str) -> None:
        self.tasks.pop(request_id, None)
        if not self.tasks:
            self._arm()

    def _arm(self) -> None:
        if self.idle_close_s and self._timer is None and not self.closed:
            self._timer = asyncio.get_running_loop().call_later(self.idle_close_s, self._went_idle)

    def _went_idle(self) -> None:
        self._timer = None
        self._idle = True
        self._ready.set()

    def put(self, request_id: str, delta: TokenDelta) -> None:
        if self.closed:
            raise ChannelClosed("the router's token channel closed")
        self.pending.setdefault(request_id, []).append(delta)
        self._ready.set()

    async def batches(self) -> AsyncIterator[dict[str, list[TokenDelta]]]:
        """Everything put since the last batch; ends once idle for idle_close_s."""
        self._arm()
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                if self._idle and not self.tasks and not self.pending:
                    return
                self._idle = False
                batch, self.pending = self.pending, {}
                if batch:
                    yield batch
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None


class Channels:
    """The open channels of one decode replica, by router replica id."""

    def __init__(self, idle_close_s: float = IDLE_CLOSE_S) -> None:
        self.open: dict[str, Channel] = {}
        self.idle_close_s = idle_close_s
        self._told: dict[str, float] = {}  # router → when a request last went without its channel
        self._opened: dict[str, asyncio.Event] = {}  # router → set when its channel opens

    def claim(self, router: str) -> tuple[Channel | None, bool]:
        """(the router's channel here or None, whether its subscription is on its way). Neither:
        the request goes on its own stream, and its StreamStart has the router subscribe; for
        SUBSCRIBE_WAIT_S after that, a request finds the subscription on its way (`opened`)."""
        channel = self.open.get(router)
        if channel is not None:
            return channel, False
        told = self._told.get(router)
        if told is not None and time.monotonic() - told <= SUBSCRIBE_WAIT_S:
            return None, True
        self._told[router] = time.monotonic()
        return None, False

    async def opened(self, router: str) -> Channel | None:
        """The router's channel once its subscription arrives; None if it has not within
        SUBSCRIBE_WAIT_S of the request that told it to subscribe."""
        told = self._told.get(router)
        if router not in self.open and told is not None:
            opened = self._opened.setdefault(router, asyncio.Event())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(opened.wait(), told + SUBSCRIBE_WAIT_S - time.monotonic())
        return self.open.get(router)

    def cancel(self, request_id: str) -> bool:
        """Cancel R's generate call on whichever channel carries it (R is aborted there)."""
        for channel in self.open.values():
            task = channel.tasks.get(request_id)
            if task is not None:
                task.cancel()
                return True
        return False

    async def serve(self, router: str) -> AsyncIterator[dict[str, list[TokenDelta]]]:
        """The router's batches until it closes the stream (a newer subscription of the same
        router takes over the name; requests already on this one stay on it)."""
        channel = self.open[router] = Channel(self.idle_close_s)
        self._told.pop(router, None)
        opened = self._opened.pop(router, None)
        if opened is not None:
            opened.set()
        try:
            async for batch in channel.batches():
                yield batch
        finally:
            channel.closed = True
            if self.open.get(router) is channel:
                del self.open[router]
            for task in channel.tasks.values():  # nobody reads their tokens any more
                task.cancel()
