"""Whose prompt the prefill engine takes next, under `scheduling_policy: priority`.

A prefill replica runs prompts one after the other on its engine thread (prefill/server.py).
Submitted straight to that thread they would run in arrival order; through `Turns` one job at a
time holds the turn, and when it ends the waiting job ranked first (lower `priority`, then
arrival) gets it. A waiter that is cancelled leaves the line; one cancelled just as the turn
reached it passes the turn on.

    async with turns.turn(params.priority):
        await run_on_engine_thread(prefill, ...)
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from typing import AsyncIterator


class Turns:
    def __init__(self) -> None:
        self._held = False
        self._line: list[tuple[int, int, asyncio.Future]] = []  # (priority, arrival, waiter): a heap
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for *_, fut in self._line if not fut.done())

    @contextlib.asynccontextmanager
    async def turn(self, priority: int = 0) -> AsyncIterator[None]:
        if self._held:
            waiter = asyncio.get_running_loop().create_future()
            heapq.heappush(self._line, (priority, next(self._arrivals), waiter))
            try:
                await waiter  # the turn is handed over with the result: _held stays True
            except asyncio.CancelledError:
                if waiter.done() and not waiter.cancelled():  # handed the turn, then cancelled
                    self._pass_on()
                raise
        else:
            self._held = True
        try:
            yield
        finally:
            self._pass_on()

    def _pass_on(self) -> None:
        while self._line:
            *_, waiter = heapq.heappop(self._line)
            if not waiter.done():  # skip those cancelled while waiting
                waiter.set_result(None)
                return
        self._held = False
