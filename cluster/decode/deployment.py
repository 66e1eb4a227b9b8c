"""The decode pool on Ray Serve: a thin shell over `DecodeServer`. In disaggregated mode it
holds a handle to the prefill pool and asks it for each request's prompt KV."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from typing import Any, AsyncIterator, Sequence

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster import cpu_binding
from cluster.app_config import SHUTDOWN_POLL_S, AppConfig
from cluster.engine.outputs import StreamStart, TokenDelta
from cluster.pool_replica import PoolReplica, on_cpu, one_torch_thread
from cluster.kvtransfer.handoff import PrefillHandoff, PrefillReplicaLost, Receiver
from cluster.sampling_params import SamplingParams
from cluster.stats_board import PERIOD_S, board

FIRST_VIEW_POLL_S = 0.05  # how often the decode replica looks for the prefill pool's first post


class ServePrefillClient:
    """`PrefillClient` over the prefill pool's handle; acks are pinned to the replica that holds R."""

    def __init__(self, handle: DeploymentHandle) -> None:
        # By reference, always: a shared_store receipt holds an ObjectRef, and Serve's by-value
        # (gRPC) transport, the default under RAY_SERVE_THROUGHPUT_OPTIMIZED=1, would pickle it
        # out of band, which pins the prompt's KV in the object store for the replica's life.
        self.handle = handle.options(_by_reference=True)

    async def prefill(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                      receiver: Receiver) -> PrefillHandoff:
        from ray import exceptions as rex

        response = self.handle.prefill.remote(request_id, list(prompt_token_ids), params, receiver)
        try:
            return await response
        except asyncio.CancelledError:  # R was aborted here: stop the prefill too (Ray's recursive
            response.cancel()           # cancel reaches it only when our own call was a Ray task)
            raise
        except (rex.RayActorError, rex.ActorUnavailableError) as exc:  # died before answering: try another
            raise PrefillReplicaLost(f"the prefill replica was lost: {type(exc).__name__}") from None

    async def ack(self, handoff: PrefillHandoff) -> None:
        # its own context: Serve would tag it with the prefill call's request id (see router app)
        await contextvars.Context().run(self.handle.ack.remote, handoff.request_id, replica_id=handoff.origin)


@serve.deployment(name="DecodePool", max_ongoing_requests=64, ray_actor_options={"num_cpus": 1},
                  graceful_shutdown_wait_loop_s=SHUTDOWN_POLL_S)
class DecodeDeployment(PoolReplica):
    pool = "decode"

    def __init__(self, config: dict[str, Any], prefill: DeploymentHandle | None = None) -> None:
        from cluster.decode.server import DecodeServer  # (torch: here, not where the app is built)

        app = AppConfig.from_args(config)
        threads = one_torch_thread()
        cpus = cpu_binding.bind("decode", app.cpu_binding and on_cpu(app.engine), threads)  # before the
        # engine's threads start and its memory is first touched
        super().__init__(DecodeServer(app), cpus, peers=[prefill] if prefill is not None else [])
        self.prefill = ServePrefillClient(prefill) if prefill is not None else None
        self._watcher: asyncio.Task | None = None
        with contextlib.suppress(RuntimeError):  # (on Serve's event loop) placement reads the prefill
            self._ensure_watching()  # pool from the start: its first requests are not placed blind

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       mux: str | None = None) -> AsyncIterator[list[TokenDelta] | StreamStart]:
        """R's deltas (DecodeServer.generate); `mux`: the calling router replica, whose channel
        here (`subscribe`) carries them when open."""
        self._ensure_posting()
        self._ensure_watching()
        async for deltas in self.server.generate(request_id, prompt_token_ids, params, self.prefill, mux):
            yield deltas

    async def subscribe(self, router: str, replica_id: str = "") -> AsyncIterator[dict[str, list[TokenDelta]]]:
        """A router replica's channel: every step's deltas of its requests here, in one message
        (decode/channels.py), after an empty one that says it opened here. `replica_id` is read by
        the pool's request router to pin the call here; a call for another replica (gone: Serve's
        router sent it on) ends at once, empty (router/mux.py then forgets that replica)."""
        if replica_id and replica_id != self.replica_id:
            return
        yield {}
        async for batch in self.server.channels.serve(router):
            yield batch

    async def cancel(self, request_id: str, replica_id: str = "") -> bool:
        """Abort R, whose tokens go over a channel (its own stream carries nothing Serve would
        notice a cancel on); `replica_id` pins the call here."""
        return self.server.channels.cancel(request_id)

    async def check_health(self) -> None:
        self._ensure_watching()  # again, should it have stopped
        await super().check_health()

    def _ensure_watching(self) -> None:
        if self.prefill is not None and self.server.places_by_slo and (self._watcher is None or self._watcher.done()):
            self._watcher = asyncio.get_running_loop().create_task(self._watch_prefill_pool())

    async def _watch_prefill_pool(self) -> None:
        """Keep the prefill pool's last posted load and step cost at hand for placement by SLO."""
        from cluster.decode.server import PREFILL_POOL_KEYS

        b = board(self.app_name)
        while True:
            try:
                self.server.observe_prefill_pool(await b.read_pool.remote("prefill", list(PREFILL_POOL_KEYS)))
            except Exception:  # the board restarting: try again next period
                b = board(self.app_name)
            # until the pool's first post is seen (both pools just started), look again soon
            await asyncio.sleep(PERIOD_S if self.server.has_seen_prefill_pool else FIRST_VIEW_POLL_S)
