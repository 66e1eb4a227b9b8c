"""The prefill replica's line under the priority policy (cluster/prefill/turns.py): one job
holds the turn; then the waiting job ranked first (lower priority value, then arrival); a
waiter that gives up leaves the line and never blocks the ones behind it."""

from __future__ import annotations

import asyncio

from cluster.prefill.turns import Turns


async def _line_up(turns: Turns, priorities: list[int], served: list[int]) -> list[asyncio.Task]:
    async def job(i: int, priority: int) -> None:
        async with turns.turn(priority):
            served.append(i)
            await asyncio.sleep(0)

    tasks = []
    for i, p in enumerate(priorities):
        tasks.append(asyncio.create_task(job(i, p)))
        await asyncio.sleep(0)  # queued in list order
    return tasks


def test_the_turn_goes_to_the_lowest_value_then_the_earliest_and_cancelled_waiters_leave():
    async def go():
        turns, served = Turns(), []
        async with turns.turn():
            tasks = await _line_up(turns, [5, 0, 5, -1, 0], served)
            tasks[1].cancel()  # gave up while waiting
            await asyncio.sleep(0)
            assert turns.waiting == 4 and served == []
        await asyncio.gather(*tasks, return_exceptions=True)
        async with turns.turn():  # free again: taken at once
            pass
        return served

    assert asyncio.run(go()) == [3, 4, 0, 2]


def test_a_waiter_cancelled_as_the_turn_reaches_it_passes_the_turn_on():
    async def go():
        turns, served = Turns(), []
        async with turns.turn():
            tasks = await _line_up(turns, [0, 1], served)
        tasks[0].cancel()  # handed the turn by the release above, cancelled before it ran
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 5)
        return served, turns.waiting

    assert asyncio.run(go()) == ([1], 0)
