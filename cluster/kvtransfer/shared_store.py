"""Shared CPU store connector: the Ray object store carries the packed KV.

    prefill: ref = ray.put(payload)      receipt = {"header": msgpack bytes, "ref": ref}
    router:  passes the receipt along (the ref is borrowed, not resolved)
    decode:  check header → ray.get(ref) (zero-copy view on the same node; Ray moves it
             across nodes) → verify → unpack → drop the ref

The object is freed when the last reference goes: the decode side drops its own after
`receive`, the router after handing the receipt over. If the prefill actor (the owner) dies
first, `ray.get` fails and that is a KVPeerGoneError.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cluster.kvtransfer.base import Expected, KVConnector, register
from cluster.kvtransfer.errors import KVFrameError, KVPeerGoneError, KVTimeoutError, KVTransferError
from cluster.kvtransfer.wire import KVHeader, KVLayout


@register("shared_store")
class SharedStoreConnector(KVConnector):
    zero_copy = True  # same node: the decode side reads the object store's memory in place
    cross_node = True
    needs_ray = True

    def __init__(self, layout: KVLayout, *, max_payload_bytes: int = 1 << 30, timeout_s: float = 30.0) -> None:
        super().__init__(layout, max_payload_bytes=max_payload_bytes, timeout_s=timeout_s)
        import ray

        if not ray.is_initialized():
            raise KVTransferError("the shared_store connector needs a running Ray (ray.init)")
        self._ray = ray

    def _receiver_address(self) -> dict[str, Any]:
        return {}

    def _transmit(self, header: KVHeader, payload: memoryview, receiver: dict[str, Any]) -> dict[str, Any]:
        return self.put_frames(header.encode(), payload)

    def put_frames(self, header: bytes, payload: Any) -> dict[str, Any]:
        """Put raw bytes in the store; returns the receipt (also the fault-test hook)."""
        ref = self._ray.put(np.frombuffer(payload, dtype=np.uint8))
        return {"header": bytes(header), "ref": ref}

    def _fetch(self, expected: Expected, receipt: dict[str, Any], timeout_s: float) -> tuple[bytes, Any]:
        header = receipt.get("header")
        ref = receipt.get("ref")
        if not isinstance(header, bytes) or not isinstance(ref, self._ray.ObjectRef):
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
