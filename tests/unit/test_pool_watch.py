"""The router's view of its pools (one with no replica taking calls gets a fast 503): looked up
in Serve's status each POOL_WATCH_PERIOD_S while requests come, not at all once none has for
POOL_WATCH_IDLE_S (a look costs Serve's controller ~3 ms of CPU, the router ~1 ms)."""

from __future__ import annotations

import asyncio

from cluster.router import app as router_app

BOTH = {"DecodePool": 1, "PrefillPool": 1}
NO_PREFILL = {"DecodePool": 1, "PrefillPool": 0}


def router(views: list[dict[str, int]]):
    """The Router's class without Serve (no constructor): each look at the pools takes the next
    of `views` (the last one from then on) and is counted."""
    cls = router_app.RouterDeployment.func_or_class
    r = cls.__new__(cls)
    r.pools, r.running, r._watcher, r._asked, r.looks = ("DecodePool", "PrefillPool"), None, None, 0.0, 0
    r.pool_watch_period_s, r.pool_watch_idle_s = 0.05, 0.3

    async def look() -> None:
        r.looks += 1
        r.running = views[min(r.looks, len(views)) - 1]

    r._look_at_pools = look
    return r


def test_the_router_looks_at_its_pools_while_requests_come_and_not_while_idle():
    async def main() -> None:
        r = router([BOTH, NO_PREFILL])
        assert await r._empty_pool() is None and r.looks == 1  # the first request waits for a look
        await asyncio.sleep(0.2)
        assert await r._empty_pool() == "PrefillPool"  # the watcher's looks since: the pool emptied
        await asyncio.sleep(1.0)  # no request: the watcher stops after POOL_WATCH_IDLE_S
        stopped = r.looks
        await asyncio.sleep(0.5)
        assert r._watcher.done() and r.looks == stopped < 1.3 / 0.05

        # the next request finds a view with an empty pool: it looks again before refusing
        r2 = router([NO_PREFILL, BOTH])
        r2.running, r2.looks = NO_PREFILL, 1
        assert await r2._empty_pool() is None and r2.looks == 2  # the pool came back: not refused
        # with a view of both pools up, it answers at once and the watcher starts again
        r3 = router([BOTH])
        r3.running = BOTH
        assert await r3._empty_pool() is None and r3.looks == 0
        await asyncio.sleep(0.2)
        assert r3.looks >= 2 and not r3._watcher.done()
        for t in (r._watcher, r2._watcher, r3._watcher):
            t.cancel()

    asyncio.run(main())
