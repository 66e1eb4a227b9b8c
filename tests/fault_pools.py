"""Tandem's pool deployments with fault hooks, for the cluster tests only: production code
carries none. Deploy them with `fault_pools:build_app` as the Serve import path (or
`serve.run(fault_pools.build_app(args))`); they behave as the real pools until a test arms one:

    serve.get_deployment_handle("DecodePool", APP).inject_fault.remote("slow_steps")

    DecodePool   wedge         the engine's step loop stops for good (what the health check catches)
                 slow_steps    50 ms pauses after every step for 30 s (a request outlives its caller)
                 delay_fetch   the next KV fetch starts 1.5 s late
    PrefillPool  exit_after_handoff  the next hand-off is answered, then the replica dies 0.3 s later

And from its start, in every replica of a pool: a pause after each engine step, of as many seconds
as the env var TANDEM_TEST_STEP_PAUSE_S says (a pool's `ray_actor_options.runtime_env.env_vars`),
so that a tiny model's request lasts long enough for a test to act while it runs.

Ray workers import this module (tests/conftest.py puts tests/ on their PYTHONPATH).
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
from typing import Any

from ray import serve

from cluster.decode.deployment import DecodeDeployment
from cluster.prefill.deployment import PrefillDeployment
from cluster.router.app import compose_app


def slow_steps(engine: Any, pause_s: float, for_s: float) -> None:
    """Pause `pause_s` after each of `engine`'s (an LLMEngine's) steps for the next `for_s` s."""
    step, until = engine.step, time.monotonic() + for_s

    def slow_step():
        outs = step()
        if time.monotonic() < until:
            time.sleep(pause_s)
        return outs

    engine.step = slow_step


def delay_next_fetch(importer: Any, delay_s: float) -> None:
    """The importer's next `fetch` (run off the engine thread) starts `delay_s` late."""
    fetch = importer.fetch

    def late_fetch(*args):
        importer.fetch = fetch
        time.sleep(delay_s)
        return fetch(*args)

    importer.fetch = late_fetch


STEP_PAUSE_ENV = "TANDEM_TEST_STEP_PAUSE_S"


def step_pause_env(pause_s: float) -> dict[str, Any]:
    """A pool deployment's `ray_actor_options` entry that slows its engines from their start."""
    return {"runtime_env": {"env_vars": {STEP_PAUSE_ENV: str(pause_s)}}}


def slowed_from_the_start(server: Any) -> None:
    pause_s = float(os.environ.get(STEP_PAUSE_ENV, 0))
    if pause_s:
        slow_steps(server.engine.engine, pause_s, math.inf)


class FaultyDecode(DecodeDeployment.func_or_class):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        slowed_from_the_start(self.server)

    async def inject_fault(self, kind: str) -> None:
        engine = self.server.engine  # the AsyncEngine
        if kind == "wedge":
            self._wedged = asyncio.ensure_future(engine.call(threading.Event().wait))
        elif kind == "slow_steps":
            slow_steps(engine.engine, 0.05, 30.0)
        elif kind == "delay_fetch":
            delay_next_fetch(self.server.importer, 1.5)
        else:
            raise ValueError(f"unknown decode fault {kind!r}")


class FaultyPrefill(PrefillDeployment.func_or_class):
    exit_after_handoff = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        slowed_from_the_start(self.server)

    async def inject_fault(self, kind: str) -> None:
        if kind != "exit_after_handoff":
            raise ValueError(f"unknown prefill fault {kind!r}")
        self.exit_after_handoff = True

    async def prefill(self, *args: Any) -> Any:
        handoff = await super().prefill(*args)
        if self.exit_after_handoff:  # dies with R's KV put/pushed, before decode admits it
            asyncio.get_running_loop().call_later(0.3, os._exit, 1)
        return handoff


FAULTY_DECODE = DecodeDeployment.options(func_or_class=FaultyDecode)
FAULTY_PREFILL = PrefillDeployment.options(func_or_class=FaultyPrefill)


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    return compose_app(args, FAULTY_PREFILL, FAULTY_DECODE)
