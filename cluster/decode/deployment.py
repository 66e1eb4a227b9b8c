"""The decode pool on Ray Serve: a thin shell over `DecodeServer`. In disaggregated mode it
holds a handle to the prefill pool and asks it for each request's prompt KV."""

from __future__ import annotations

import asyncio
import contextvars
import time
from typing import Any, AsyncIterator, Sequence

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.config import AppConfig
from cluster.router.stats_board import post_forever
from cluster.decode.server import DecodeServer
from cluster.outputs import TokenDelta
from cluster.prefill.deployment import _one_thread
from cluster.prefill.worker import PrefillHandoff
from cluster.sampling_params import SamplingParams

WEDGED_AFTER_S = 30.0  # a busy engine whose loop has not turned for this long is unhealthy


class ServePrefillClient:
    """`PrefillClient` over the prefill pool's handle; acks are pinned to the replica that holds R."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      receiver: dict[str, Any]) -> PrefillHandoff:
        return await self.handle.prefill.remote(request_id, list(prompt_token_ids), params, receiver)

    async def ack(self, handoff: PrefillHandoff) -> None:
        # its own context: Serve would tag it with the prefill call's request id (see router app)
        await contextvars.Context().run(self.handle.ack.remote, handoff.request_id, replica_id=handoff.origin)


@serve.deployment(name="DecodePool", max_ongoing_requests=64, ray_actor_options={"num_cpus": 1})
class DecodeDeployment:
    def __init__(self, config: dict[str, Any], prefill: DeploymentHandle | None = None) -> None:
        _one_thread()
        self.config = AppConfig.from_args(config)
        self.server = DecodeServer(self.config)
        self.prefill = ServePrefillClient(prefill) if prefill is not None else None
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.app_name = ctx.app_name
        self._poster: asyncio.Task | None = None

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[list[TokenDelta]]:
        self._ensure_posting()
        async for deltas in self.server.generate(request_id, prompt_token_ids, params, self.prefill):
            yield deltas

    async def stats(self) -> dict[str, Any]:
        return {"pool": "decode", "replica": self.replica_id, **await self.server.stats()}

    def record_routing_stats(self) -> dict[str, Any]:
        return self.server.routing_stats()

    def _ensure_posting(self) -> None:
        if self._poster is None or self._poster.done():
            self._poster = asyncio.get_running_loop().create_task(
                post_forever(self.app_name, self.replica_id, self.stats))

    async def check_health(self) -> None:
        self._ensure_posting()
        engine = self.server.engine
        if not engine.alive:
            raise RuntimeError("the engine loop has stopped")
        if time.monotonic() - engine.last_step_at > WEDGED_AFTER_S:
            raise RuntimeError(f"the engine loop has not turned for {WEDGED_AFTER_S:.0f}s")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()
