"""Where every replica of both pools posts its stats (a small named Ray actor), so the router
can answer /debug/stats for the whole app: Serve handles reach one replica per call, not all.

Replicas post every `PERIOD_S`; entries older than `STALE_S` (a replica that died) are dropped.
Routers also post the traces they recorded since their last post (a "traces" list in the
stats), kept in a bounded ring by request id, so any router answers /debug/requests/{id}.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable

import ray

PERIOD_S = 0.5
STALE_S = 5.0
KEEP_TRACES = 8192  # request ids


@ray.remote(num_cpus=0)
class StatsBoard:
    def __init__(self) -> None:
        self.entries: dict[str, tuple[float, dict[str, Any]]] = {}
        self.traces: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()

    def post(self, replica: str, stats: dict[str, Any]) -> None:
        for trace in stats.pop("traces", None) or []:
            self.traces.setdefault(trace["request_id"], []).append(trace)
            self.traces.move_to_end(trace["request_id"])
        while len(self.traces) > KEEP_TRACES:
            self.traces.popitem(last=False)
        self.entries[replica] = (time.monotonic(), stats)

    def trace(self, request_id: str) -> list[dict[str, Any]] | None:
        return self.traces.get(request_id)

    def remove(self, replica: str) -> None:
        self.entries.pop(replica, None)

    def read_pool(self, pool: str, keys: list[str]) -> list[dict[str, Any]]:
        """`keys` of each live replica of one pool: what a decode replica's placement reads of the
        prefill pool, without the histograms."""
        return [{k: stats.get(k) for k in keys} for stats in self.read() if stats.get("pool") == pool]

    def read(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        self.entries = {k: v for k, v in self.entries.items() if now - v[0] <= STALE_S}
        return [stats for _, stats in self.entries.values()]


def board(app_name: str) -> Any:
    return StatsBoard.options(name=f"tandem-stats-{app_name}", namespace="serve",
                              get_if_exists=True).remote()


async def ask_board(app_name: str, method: str, *args: Any) -> Any:
    """Call the board, once more on a new one if it died: it goes down with the replica that
    created it (its owner), and the replicas post again within a period."""
    try:
        return await getattr(board(app_name), method).remote(*args)
    except ray.exceptions.ActorDiedError:
        return await getattr(board(app_name), method).remote(*args)


async def post_forever(app_name: str, replica: str, collect: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    b = board(app_name)
    while True:
        try:
            await b.post.remote(replica, {**await collect(), "posted_at": time.time()})
        except Exception:  # the board restarting, or shutdown: try again next period
            b = board(app_name)
        await asyncio.sleep(PERIOD_S)
