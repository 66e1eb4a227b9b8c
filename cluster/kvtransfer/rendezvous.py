"""Rendezvous for the collective connector without a TCPStore: a group's keys live in the
sending connector (`KeyStore`); the receiving side reaches them through Ray actor calls on the
sender's hosting actor (`control`), wrapped as a `torch.distributed.Store` (`TorchStore`).
On Ray Serve the hosting actor is a pool replica, reached by deployment handle + replica id,
each call made on the replica's own event loop through the handle the replica was built with
(`serve_peers_from`), never through a second handle to the same deployment made in a thread.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch.distributed as dist

from cluster.kvtransfer.errors import KVPeerGoneError, KVTimeoutError, KVTransferError

STORE_METHODS = frozenset({"set", "get", "wait", "check", "add"})  # what gloo and nccl call


class KeyStore:
    """One group's rendezvous keys, kept by its sender; waits are bounded by `max_wait_s`."""

    def __init__(self, max_wait_s: float) -> None:
        self._cond = threading.Condition()
        self._data: dict[str, bytes] = {}
        self._max_wait_s = max_wait_s

    def call(self, method: str, *args: Any) -> Any:
        if method not in STORE_METHODS:
            raise KVTransferError(f"no store method {method!r}")
        with self._cond:
            return getattr(self, f"_{method}")(*args)

    def _await(self, keys: list[str], timeout_s: float) -> None:
        if not self._cond.wait_for(lambda: all(k in self._data for k in keys), min(timeout_s, self._max_wait_s)):
            raise KVTimeoutError(f"group rendezvous: keys {keys} not set within {timeout_s:.1f}s")

    def _set(self, key: str, value: bytes) -> None:
        self._data[key] = bytes(value)
        self._cond.notify_all()

    def _get(self, key: str, timeout_s: float) -> bytes:
        self._await([key], timeout_s)
        return self._data[key]

    def _wait(self, keys: list[str], timeout_s: float) -> None:
        self._await(keys, timeout_s)

    def _check(self, keys: list[str]) -> bool:
        return all(k in self._data for k in keys)

    def _add(self, key: str, delta: int) -> int:
        value = int(self._data.get(key, b"0")) + delta
        self._set(key, str(value).encode())
        return value



class TorchStore(dist.Store):
    """A torch Store over `call(method, *args)`: the sender's KeyStore, directly or via Ray."""

    def __init__(self, call: Callable[..., Any], timeout_s: float) -> None:
        super().__init__()
        self._call, self._timeout_s = call, timeout_s

    def set(self, key: str, value: bytes) -> None:
        self._call("set", key, bytes(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key, self._timeout_s)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else 0
        self._call("wait", list(keys), min(seconds, self._timeout_s) if seconds > 0 else self._timeout_s)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def add(self, key: str, value: int) -> int:
        return self._call("add", key, int(value))


@dataclass(frozen=True)
class ServeReplica:
    """A peer that is a Ray Serve replica: reached through its deployment's handle, pinned to
    the replica by the `replica_id` keyword (the pools' request routers honour it)."""
    app: str
    deployment: str
    replica_id: str


def current_actor() -> Any:
    """How peers reach this process's `kv_control`: its Serve replica, or its Ray actor."""
    import ray

    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        try:
            from ray import serve

            ctx = serve.get_replica_context()
            return ServeReplica(ctx.app_name, ctx.deployment, ctx.replica_id.unique_id)
        except Exception:  # not a Serve replica: a plain actor with a kv_control method
            return ray.get_runtime_context().current_actor
    raise KVTransferError("the collective connector must live inside a Ray actor "
                          "(groups rendezvous through the hosting actor's kv_control)")


class _ServePeers:
    """How this replica process reaches peer replicas: on its event loop, through the handles it
    was built with. A second handle to a deployment this process already has a handle to,
    made later, can miss the deployment's replicas for good (Ray Serve 2.60's shared long poll
    can stop the new router's first poll before its first update lands: seen as a collective
    receiver whose store calls never reached the sender, every group formation timing out
    for the replica's life)."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.handles: dict[tuple[str, str], Any] = {}

    def handle(self, app: str, deployment: str) -> Any:
        """Called on `loop`: the handle this replica was built with, else one made here, once."""
        key = (app, deployment)
        if key not in self.handles:
            from ray import serve

            self.handles[key] = serve.get_deployment_handle(deployment, app)
        return self.handles[key]


_peers = _ServePeers()


def serve_peers_from(loop: asyncio.AbstractEventLoop, handles: dict[tuple[str, str], Any]) -> None:
    """A pool replica, on its event loop: make this process's control calls on `loop`, through
    `handles` ((app, deployment) → the DeploymentHandle the replica was built with)."""
    _peers.loop = loop
    _peers.handles.update(handles)


def control(actor: Any, op: str, args: dict[str, Any], timeout_s: float) -> Any:
    """One `kv_control` call on a peer's hosting actor or replica; failures become typed errors.
    Called from plain threads (never from an event loop: it blocks)."""
    import ray
    from ray import exceptions as rex

    try:
        if isinstance(actor, ServeReplica):
            return _on_replica_loop(actor, op, args, timeout_s)
        return ray.get(actor.kv_control.remote(op, args), timeout=timeout_s)
    except (rex.GetTimeoutError, TimeoutError):
        raise KVTimeoutError(f"peer did not answer {op!r} within {timeout_s:.1f}s") from None
    except (rex.RayActorError, rex.ActorUnavailableError) as exc:
        raise KVPeerGoneError(f"peer is gone ({op!r}): {type(exc).__name__}") from None
    except rex.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, KVTransferError):
            raise type(cause)(str(cause)) from None
        raise KVTransferError(f"peer failed {op!r}: {cause!r}") from None


def _on_replica_loop(peer: ServeReplica, op: str, args: dict[str, Any], timeout_s: float) -> Any:
    loop = _peers.loop
    if loop is None or loop.is_closed():  # not in a pool replica that said where: a handle of our own
        from ray import serve

        handle = serve.get_deployment_handle(peer.deployment, peer.app)
        return handle.kv_control.remote(op, args, replica_id=peer.replica_id).result(timeout_s=timeout_s)

    if _running_loop() is loop:
        raise KVTransferError("control() blocks: call it from a thread, not the replica's event loop")

    async def call() -> Any:
        return await _peers.handle(peer.app, peer.deployment).kv_control.remote(op, args, replica_id=peer.replica_id)

    future = asyncio.run_coroutine_threadsafe(call(), loop)
    try:
        return future.result(timeout_s)
    except TimeoutError:
        future.cancel()
        raise


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
