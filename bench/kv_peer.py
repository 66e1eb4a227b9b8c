"""The two sides of bench/kvtransfer.py's transfers: a Ray actor hosting one connector of
every kind (plus raw zmq sockets or a raw gloo group), and one timed transfer of each kind
driven from the bench. How the timing works is in bench/kvtransfer.py's docstring."""

from __future__ import annotations

import os
import statistics
import threading
import time
import zlib
from typing import Any

import ray
import torch

LAYOUT_ARGS = dict(model="SmolLM2-135M-Instruct", num_layers=30, num_kv_heads=3, head_dim=64,
                   block_size=16, dtype="float32")
TIMEOUT_S = 60.0


def median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def kv_layout():
    from cluster.engine.kv_layout import KVLayout

    return KVLayout(**LAYOUT_ARGS)


def _make_connector(name: str, layout) -> Any:
    from cluster.kvtransfer.connectors import create_connector

    # shared_store: prefaulted, as the bench preallocates the store (see bench/kvtransfer.py)
    options = {"collective": {"backend": "gloo"}, "shared_store": {"prefault": True}}.get(name, {})
    return create_connector(name, layout, timeout_s=TIMEOUT_S, **options)


@ray.remote(num_cpus=0, max_concurrency=4)
class Peer:
    """One side of a transfer: hosts the connectors (and raw sockets, or a raw gloo group)."""

    def __init__(self, connectors: list[str]) -> None:
        torch.set_num_threads(1)
        self.layout = kv_layout()
        self.conns = {name: _make_connector(name, self.layout) for name in connectors}
        self.payloads: dict[int, torch.Tensor] = {}
        self._events: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._zmq_ctx = None
        self._pull = None
        self._push = None
        self._gloo_buf: dict[int, torch.Tensor] = {}

    def pid(self) -> int:
        return os.getpid()

    # -- connectors --------------------------------------------------------------------
    def kv_control(self, op: str, args: dict[str, Any]) -> Any:
        return self.conns["collective"].on_control(op, args)

    def make_payload(self, num_blocks: int, seed: int) -> int:
        if num_blocks not in self.payloads:
            gen = torch.Generator().manual_seed(seed)
            self.payloads[num_blocks] = torch.randn(self.layout.payload_shape(num_blocks), generator=gen)
        return self.payloads[num_blocks].numel() * self.payloads[num_blocks].element_size()

    def _event(self, key: str) -> threading.Event:
        with self._lock:
            return self._events.setdefault(key, threading.Event())

    def wait_started(self, key: str) -> bool:
        ok = self._event(key).wait(TIMEOUT_S)
        with self._lock:
            self._events.pop(key, None)
        return ok

    def expect(self, name: str, rid: str, num_blocks: int) -> dict[str, Any]:
        conn = self.conns[name]
        conn.expect(rid, num_blocks)
        return conn.receiver_info()

    def recv(self, name: str, rid: str, receipt: Any = None) -> dict[str, float]:
        conn = self.conns[name]
        self._event(rid).set()
        t_start = time.time()
        from cluster.kvtransfer.handoff import Receipt

        tensor = conn.receive(rid, receipt or Receipt(), TIMEOUT_S)
        t_end = time.time()
        nbytes = tensor.numel() * tensor.element_size()
        del tensor
        return {"t_recv_start": t_start, "t_end": t_end, "nbytes": nbytes}

    def send(self, name: str, rid: str, num_blocks: int, receiver: Any,
             forward_to: Any = None) -> dict[str, float]:
        conn, payload = self.conns[name], self.payloads[num_blocks]
        tokens = num_blocks * self.layout.block_size
        t0 = time.time()
        receipt = conn.send(rid, tokens, payload, receiver)
        t1 = time.time()
        out = {"t0": t0, "t_send_done": t1}
        if forward_to is not None:  # shared_store: hand the receipt (object ref) straight over
            out.update(ray.get(forward_to.recv.remote(name, rid, receipt)))
        del receipt
        return out

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()

    # -- raw zmq -----------------------------------------------------------------------
    def zmq_bind(self) -> int:
        import zmq

        self._zmq_ctx = self._zmq_ctx or zmq.Context()
        self._pull = self._zmq_ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        return self._pull.bind_to_random_port("tcp://127.0.0.1")

    def zmq_recv(self, key: str) -> dict[str, float]:
        self._event(key).set()
        frame = self._pull.recv(copy=False)
        t_end = time.time()
        nbytes = len(frame.buffer)
        del frame
        return {"t_end": t_end, "nbytes": nbytes}

    def zmq_send(self, port: int, num_blocks: int) -> dict[str, float]:
        import zmq

        if self._push is None:
            self._zmq_ctx = self._zmq_ctx or zmq.Context()
            self._push = self._zmq_ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.connect(f"tcp://127.0.0.1:{port}")
        view = memoryview(self.payloads[num_blocks].view(torch.uint8).numpy()).cast("B")
        t0 = time.time()
        self._push.send(view, copy=False)
        return {"t0": t0}

    # -- raw gloo (this actor's default process group) ----------------------------------
    def gloo_init(self, port: int, rank: int) -> bool:
        import torch.distributed as dist

        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        return True

    def gloo_alloc(self, nbytes: int, sender: bool) -> None:
        if nbytes in self._gloo_buf:
            return
        if sender:
            gen = torch.Generator().manual_seed(nbytes)
            self._gloo_buf[nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        else:
            self._gloo_buf[nbytes] = torch.zeros(nbytes, dtype=torch.uint8)  # touched: pages present

    def gloo_recv(self, key: str, nbytes: int) -> dict[str, float]:
        import torch.distributed as dist

        buf = self._gloo_buf[nbytes]
        self._event(key).set()
        dist.recv(buf, src=0)
        return {"t_end": time.time(), "nbytes": buf.numel()}

    def gloo_send(self, nbytes: int) -> dict[str, float]:
        import torch.distributed as dist

        buf = self._gloo_buf[nbytes]
        t0 = time.time()
        dist.send(buf, dst=1)
        return {"t0": t0}

    def gloo_close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # -- one-process measurements ------------------------------------------------------
    def micro(self, num_blocks: int, repeats: int) -> dict[str, float]:
        import numpy as np

        from cluster.kvtransfer.wire import checksum

        src = self.payloads[num_blocks].view(-1).view(torch.uint8)
        view = memoryview(src.numpy()).cast("B")
        dst = torch.empty_like(src)
        dst.copy_(src)  # pages present

        def med(fn) -> float:
            fn()
            ts = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t)
            return median_ms(ts)

        def put_and_drop() -> None:
            ref = ray.put(np.frombuffer(view, dtype=np.uint8))
            del ref

        def get_mapped() -> None:  # zero-copy get of an object in the local store
            arr = ray.get(ref)
            del arr

        ref = ray.put(np.frombuffer(view, dtype=np.uint8))
        out = {
            "memcpy_ms": med(lambda: dst.copy_(src)),
            "checksum_ms": med(lambda: checksum(view)),
            "zlib_crc32_ms": med(lambda: zlib.crc32(view)),
            "ray_put_ms": med(put_and_drop),
            "ray_get_local_ms": med(get_mapped),
            "copy_into_fresh_buffer_ms": med(lambda: torch.empty_like(src).copy_(src)),
            "frombuffer_view_ms": med(lambda: torch.frombuffer(view, dtype=torch.uint8)),
        }
        del ref
        return out


# -- one transfer of each kind: returns seconds ----------------------------------------
def one_connector(name: str, sender, receiver, rid: str, nb: int) -> dict[str, float]:
    info = ray.get(receiver.expect.remote(name, rid, nb))
    if name == "shared_store":
        return ray.get(sender.send.remote(name, rid, nb, info, receiver))
    rref = receiver.recv.remote(name, rid)
    if not ray.get(receiver.wait_started.remote(rid)):
        raise RuntimeError("receiver did not start")
    st = ray.get(sender.send.remote(name, rid, nb, info))
    st.update(ray.get(rref))
    return st


def one_zmq(sender, receiver, port: int, key: str, nb: int) -> dict[str, float]:
    rref = receiver.zmq_recv.remote(key)
    if not ray.get(receiver.wait_started.remote(key)):
        raise RuntimeError("receiver did not start")
    st = ray.get(sender.zmq_send.remote(port, nb))
    st.update(ray.get(rref))
    return st


def one_gloo(a, b, key: str, nbytes: int) -> dict[str, float]:
    rref = b.gloo_recv.remote(key, nbytes)
    if not ray.get(b.wait_started.remote(key)):
        raise RuntimeError("receiver did not start")
    st = ray.get(a.gloo_send.remote(nbytes))
    st.update(ray.get(rref))
    return st
