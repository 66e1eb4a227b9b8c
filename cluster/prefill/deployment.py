"""The prefill pool on Ray Serve: a thin shell over `PrefillServer`."""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

from ray import serve

from cluster.config import AppConfig
from cluster.router.stats_board import post_forever
from cluster.prefill.server import PrefillServer
from cluster.prefill.worker import PrefillHandoff
from cluster.sampling_params import SamplingParams


@serve.deployment(name="PrefillPool", max_ongoing_requests=64, ray_actor_options={"num_cpus": 1})
class PrefillDeployment:
    def __init__(self, config: dict[str, Any]) -> None:
        _one_thread()
        self.server = PrefillServer(AppConfig.from_args(config))
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.app_name = ctx.app_name
        self._poster: asyncio.Task | None = None

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      receiver: dict[str, Any]) -> PrefillHandoff:
        self._ensure_posting()
        handoff = await self.server.prefill(request_id, prompt_token_ids, params, receiver)
        handoff.origin = self.replica_id
        return handoff

    async def ack(self, request_id: str, replica_id: str = "") -> bool:
        """`replica_id` is read by the pool's request router to pin the ack to this replica."""
        return await self.server.ack(request_id)

    async def stats(self) -> dict[str, Any]:
        return {"pool": "prefill", "replica": self.replica_id, **await self.server.stats()}

    def record_routing_stats(self) -> dict[str, Any]:
        return self.server.routing_stats()

    def _ensure_posting(self) -> None:
        if self._poster is None or self._poster.done():
            self._poster = asyncio.get_running_loop().create_task(
                post_forever(self.app_name, self.replica_id, self.stats))

    async def check_health(self) -> None:
        self._ensure_posting()
        pass

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()


def _one_thread() -> None:
    """One torch thread per replica: replicas are sized by num_cpus, not by torch's guess."""
    import os

    import torch

    torch.set_num_threads(max(1, int(float(os.environ.get("TANDEM_TORCH_THREADS", "1")))))
