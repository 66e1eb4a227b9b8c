"""Where every replica of both pools posts its stats (a small named Ray actor), so the router
can answer /debug/stats for the whole app: Serve handles reach one replica per call, not all.

Replicas post every `PERIOD_S`; entries older than `STALE_S` (a replica that died) are dropped.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import ray

PERIOD_S = 0.5
STALE_S = 5.0


@ray.remote(num_cpus=0)
class StatsBoard:
    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, dict[str, Any]]] = {}

    def post(self, replica: str, stats: dict[str, Any]) -> None:
        self.entries[replica] = (time.monotonic(), stats)

    def remove(self, replica: str) -> None:
        self.entries.pop(replica, None)

    def read(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        self.entries = {k: v for k, v in self.entries.items() if now - v[0] <= STALE_S}
        return [stats for _, stats in self.entries.values()]


def board(app_name: str) -> Any:
    return StatsBoard.options(name=f"tandem-stats-{app_name}", namespace="serve",
                              get_if_exists=True).remote()


async def post_forever(app_name: str, replica: str, collect: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    b = board(app_name)
    while True:
        try:
            await b.post.remote(replica, {**await collect(), "posted_at": time.time()})
        except Exception:  # the board restarting, or shutdown: try again next period
            b = board(app_name)
        await asyncio.sleep(PERIOD_S)
