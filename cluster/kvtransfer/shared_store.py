"""Shared CPU store connector: the Ray object store carries the packed KV.

    prefill: ref = ray.put(payload)      receipt = Receipt(msgpack header bytes, ref)
    in between: the receipt rides in the prefill call's reply (the ref is borrowed, not resolved)
    decode:  check header → ray.get(ref) (zero-copy view on the same node; Ray moves it
             across nodes) → verify → unpack → drop the ref

The object is freed when the last reference goes: the prefill side holds its own with R's
lease until the ack (or the lease's end: prefill/exporter.py), the decode side drops its own
after `receive`. If the prefill actor (the owner) dies first, `ray.get` fails and that is a
KVPeerGoneError.

`prefault=True` populates this process's page tables for its whole mapping of the store once,
at start (`prefault_object_store`). Otherwise each process takes a page fault per 4 KiB page
the first time it touches each part of the store: a 47 MB put took 11.7 ms cold and 3.2 ms
prefaulted here, a 188 MB one 35 ms and 11 ms. Meant for a store preallocated at `ray start`
(RAY_preallocate_plasma_memory=1); on one that is not, it commits the store's memory now.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import numpy as np

from cluster.kvtransfer.base import Expected, KVConnector
from cluster.kvtransfer.handoff import Receipt, Receiver
from cluster.kvtransfer.errors import KVFrameError, KVPeerGoneError, KVTimeoutError, KVTransferError
from cluster.engine.kv_layout import KVLayout
from cluster.kvtransfer.wire import KVHeader


class SharedStoreConnector(KVConnector):
    name = "shared_store"
    zero_copy = True  # same node: the decode side reads the object store's memory in place
    cross_node = True
    needs_ray = True

    def __init__(self, layout: KVLayout, *, max_payload_bytes: int = 1 << 30, timeout_s: float = 30.0,
                 prefault: bool = False) -> None:
        super().__init__(layout, max_payload_bytes=max_payload_bytes, timeout_s=timeout_s)
        import ray

        if not ray.is_initialized():
            raise KVTransferError("the shared_store connector needs a running Ray (ray.init)")
        self._ray = ray
        self.prefaulted_bytes = prefault_object_store() if prefault else 0
        if prefault and not self.prefaulted_bytes:
            logging.getLogger(__name__).warning(
                "prefault_object_store: nothing populated (no plasma mapping found, or the kernel "
                "refused MADV_POPULATE_WRITE: it needs Linux >= 5.14); transfers take page faults")

    def _receiver_address(self) -> dict[str, Any]:
        return {}

    def _transmit(self, header: KVHeader, payload: memoryview, receiver: Receiver) -> Receipt:
        return self.put_frames(header.encode(), payload)

    def put_frames(self, header: bytes, payload: Any) -> Receipt:
        """Put raw bytes in the store; returns the receipt (also the fault-test hook)."""
        ref = self._ray.put(np.frombuffer(payload, dtype=np.uint8))
        return Receipt(bytes(header), ref)

    def _fetch(self, expected: Expected, receipt: Receipt, timeout_s: float) -> tuple[bytes, Any]:
        header, ref = receipt.header, receipt.ref
        if not isinstance(header, bytes) or not header or not isinstance(ref, self._ray.ObjectRef):
            raise KVFrameError("a shared_store receipt needs 'header' bytes and an object 'ref'")
        self.check_header(header, expected)  # bounded before Ray maps or pulls anything
        try:
            payload = self._ray.get(ref, timeout=timeout_s)
        except self._ray.exceptions.GetTimeoutError:
            raise KVTimeoutError(f"KV object for {expected.request_id!r} not available within "
                                 f"{timeout_s:.1f}s") from None
        except (self._ray.exceptions.OwnerDiedError, self._ray.exceptions.ObjectLostError) as exc:
            raise KVPeerGoneError(f"KV object for {expected.request_id!r} is gone: {type(exc).__name__}") from None
        if not isinstance(payload, np.ndarray) or payload.dtype != np.uint8 or payload.ndim != 1:
            raise KVFrameError(f"KV object for {expected.request_id!r} is not a byte array")
        return header, payload


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: populate page tables (writable) without touching data


def object_store_mappings() -> list[tuple[int, int]]:
    """(start, end) of each shared mapping of a Ray object store file (plasma*) in this process."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and fields[1][3:4] == "s" and os.path.basename(fields[5]).startswith("plasma"):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    found.append((start, end))
    except OSError:  # not Linux
        pass
    return found


def populate(ranges: list[tuple[int, int]]) -> int:
    """madvise(MADV_POPULATE_WRITE) each range; returns the bytes populated (0 where refused)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return sum(end - start for start, end in ranges
               if libc.madvise(start, end - start, _MADV_POPULATE_WRITE) == 0)


def prefault_object_store() -> int:
    """Map the object store into this process (a put/get big enough not to be inlined) and
    populate its page tables; returns the bytes populated."""
    import ray

    ray.get(ray.put(np.zeros(1 << 20, dtype=np.uint8)))  # > Ray's inline limit: lands in the store
    return populate(object_store_mappings())
