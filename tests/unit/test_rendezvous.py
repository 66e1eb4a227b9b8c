"""A collective connector's control calls between Serve replicas go through the handle the
replica was built with, on its event loop (kvtransfer/rendezvous.py). Why: a second handle to
the same deployment, made later in a connector thread, missed the prefill pool's replicas for
the life of a decode replica in two CI runs (Ray Serve's shared long poll), and every KV group
formation then timed out after 30 s while requests queued behind it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import pytest

from cluster.kvtransfer import rendezvous
from cluster.kvtransfer.errors import KVTimeoutError, KVTransferError
from cluster.kvtransfer.rendezvous import ServeReplica, control, serve_peers_from


class _Handle:
    """Stands in for a DeploymentHandle: records where each kv_control call was made."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[tuple[str, dict, str, str]] = []
        self.delay_s = delay_s
        self.kv_control = self

    def remote(self, op: str, args: dict, replica_id: str = ""):
        self.calls.append((op, args, replica_id, threading.current_thread().name))

        async def answer():
            await asyncio.sleep(self.delay_s)
            return {"op": op}
        return answer()


@contextlib.contextmanager
def replica_loop(handles: dict):
    """An event loop in a thread, as Serve runs a replica's, registered as this process's."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="replica-loop", daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result()
    before = (rendezvous._peers.loop, dict(rendezvous._peers.handles))
    serve_peers_from(loop, handles)
    try:
        yield loop
    finally:
        rendezvous._peers.loop, rendezvous._peers.handles = before[0], before[1]
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result()  # a cancelled call ends
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        loop.close()


PEER = ServeReplica("tandem", "PrefillPool", "abc123")


def test_control_goes_through_the_replicas_own_handle_on_its_loop():
    handle = _Handle()
    with replica_loop({("tandem", "PrefillPool"): handle}):
        assert control(PEER, "store", {"method": "set"}, timeout_s=5) == {"op": "store"}
    assert handle.calls == [("store", {"method": "set"}, "abc123", "replica-loop")]


def test_a_peer_that_never_answers_times_out_typed():
    with replica_loop({("tandem", "PrefillPool"): _Handle(delay_s=60)}):
        start = time.monotonic()
        with pytest.raises(KVTimeoutError):
            control(PEER, "join", {}, timeout_s=0.2)
        assert time.monotonic() - start < 5


def test_a_call_from_the_replicas_loop_is_refused_not_deadlocked():
    handle = _Handle()
    with replica_loop({("tandem", "PrefillPool"): handle}) as loop:
        async def on_loop():
            return control(PEER, "join", {}, timeout_s=5)
        with pytest.raises(KVTransferError, match="from a thread"):
            asyncio.run_coroutine_threadsafe(on_loop(), loop).result(timeout=10)
    assert handle.calls == []
