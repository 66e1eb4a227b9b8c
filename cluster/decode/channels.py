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
A batch is {request id: [deltas]}, everything put since the subscriber last looked: the deltas
of one engine step arrive together (AsyncEngine hands a step's outputs to the loop at once),
so a router gets one message per step whatever the number of its streams. A channel that
closes (its router went away or gave it up) fails the requests still on it (ChannelClosed),
which the router migrates like a lost replica.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from cluster.engine.outputs import ChannelClosed, TokenDelta


class Channel:
    def __init__(self) -> None:
        self.pending: dict[str, list[TokenDelta]] = {}
        self.closed = False
        self.tasks: dict[str, asyncio.Task] = {}  # request id → the task streaming it here
        self._ready = asyncio.Event()

    def put(self, request_id: str, delta: TokenDelta) -> None:
        if self.closed:
            raise ChannelClosed("the router's token channel closed")
        self.pending.setdefault(request_id, []).append(delta)
        self._ready.set()

    async def batches(self) -> AsyncIterator[dict[str, list[TokenDelta]]]:
        while True:
            await self._ready.wait()
            self._ready.clear()
            batch, self.pending = self.pending, {}
            yield batch


class Channels:
    """The open channels of one decode replica, by router replica id."""

    def __init__(self) -> None:
        self.open: dict[str, Channel] = {}

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
        channel = self.open[router] = Channel()
        try:
            async for batch in channel.batches():
                yield batch
        finally:
            channel.closed = True
            if self.open.get(router) is channel:
                del self.open[router]
            for task in channel.tasks.values():  # nobody reads their tokens any more
                task.cancel()
