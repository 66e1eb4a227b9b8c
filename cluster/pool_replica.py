"""What a pool replica (prefill or decode) does besides its own work: one torch thread, the
cores it runs on (cluster/cpu_binding.py), its identity, routing stats for the pool's request
router, and posting its counters to the app's stats board (read by /debug/stats). The Serve
deployments subclass this."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any, Sequence

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.config import EngineConfig
from cluster.cpu_binding import CpuBinding, SharedBinding
from cluster.stats_board import post_forever


class PoolReplica:
    pool: str  # "prefill" | "decode"

    def __init__(self, server: Any, cpus: CpuBinding | SharedBinding, peers: Sequence[DeploymentHandle] = ()) -> None:
        """`peers`: the handles to other pools this replica was built with; its connector's
        control calls go through them (kvtransfer/rendezvous.py)."""
        from cluster.kvtransfer.rendezvous import serve_peers_from  # (torch.distributed)

        self.server = server  # PrefillServer | DecodeServer: stats(), routing_stats(), close()
        self.cpus = cpus  # the cores its threads run on (cluster/cpu_binding.py)
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        server.name = self.replica_id
        self.app_name = ctx.app_name
        self._poster: asyncio.Task | None = None
        with contextlib.suppress(RuntimeError):  # Serve builds a replica on its event loop: post
            self._ensure_posting()  # from the start, not from the first call or health check,
            # and make the connector's control calls on this loop, through the handles built with it
            serve_peers_from(asyncio.get_running_loop(), {(h.app_name, h.deployment_name): h for h in peers})

    async def stats(self) -> dict[str, Any]:
        return {"pool": self.pool, "replica": self.replica_id, "pid": os.getpid(), "cpus": self.cpus.describe(),
                **await self.server.stats()}

    async def kv_control(self, op: str, args: dict[str, Any], replica_id: str = "") -> Any:
        """A peer connector's control call (the collective connector's group rendezvous);
        `replica_id` pins it to this replica. Runs off the event loop: store waits block."""
        connector = getattr(self.server, "connector", None)
        if connector is None:
            raise RuntimeError("this replica has no KV connector (colocated mode)")
        return await asyncio.to_thread(connector.on_control, op, args)

    def record_routing_stats(self) -> dict[str, Any]:
        return self.server.routing_stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What the pool's autoscaling policy (cluster/autoscaling.py) scales on."""
        return self.server.autoscaling_stats()

    async def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising marks the replica unhealthy and
        Serve replaces it (a wedged engine: see `stall_timeout_s`)."""
        self._ensure_posting()
        self.server.check_health()

    def _ensure_posting(self) -> None:
        if self._poster is None or self._poster.done():
            self._poster = asyncio.get_running_loop().create_task(
                post_forever(self.app_name, self.replica_id, self.stats))

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()


def one_torch_thread(threads: int | None = None) -> int:
    """One torch thread per replica (or `threads`): replicas are sized by num_cpus, not by torch's
    guess. TANDEM_TORCH_THREADS, when set, wins. Returns the count."""
    import torch

    count = max(1, int(float(os.environ.get("TANDEM_TORCH_THREADS", threads or 1))))
    torch.set_num_threads(count)
    return count


def on_cpu(engine: EngineConfig) -> bool:
    """Whether this engine computes on the CPU (where its replica's cores are bound)."""
    from cluster.engine.model_runner import pick_device

    return pick_device(engine.model.device).type == "cpu"
