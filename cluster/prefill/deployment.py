"""The prefill pool on Ray Serve: a thin shell over `PrefillServer`."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from ray import serve

from cluster import cpu_binding
from cluster.app_config import SHUTDOWN_POLL_S, AppConfig
from cluster.kvtransfer.handoff import PrefillHandoff, Receiver
from cluster.pool_replica import PoolReplica, on_cpu, one_torch_thread
from cluster.sampling_params import SamplingParams


@serve.deployment(name="PrefillPool", max_ongoing_requests=64, ray_actor_options={"num_cpus": 1},
                  graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
class PrefillDeployment(PoolReplica):
    pool = "prefill"

    def __init__(self, config: dict[str, Any]) -> None:
        from cluster.prefill.server import PrefillServer  # (torch: here, not where the app is built)

        app = AppConfig.from_args(config)
        one_torch_thread(app.prefill_torch_threads)
        cpus = cpu_binding.bind("prefill", app.cpu_binding and on_cpu(app.engine))  # the cores decode leaves
        super().__init__(PrefillServer(app), cpus)

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      receiver: Receiver) -> PrefillHandoff:
        self._ensure_posting()
        handoff = await self.server.prefill(request_id, prompt_token_ids, params, receiver)
        return dataclasses.replace(handoff, origin=self.replica_id)

    async def ack(self, request_id: str, replica_id: str = "") -> bool:
        """`replica_id` is read by the pool's request router to pin the ack to this replica."""
        return await self.server.ack(request_id)
