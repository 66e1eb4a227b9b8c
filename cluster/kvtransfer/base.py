"""The KV-transfer contract every connector implements, its errors, and the registry.

One request R moves from prefill actor P to decode actor D. Who calls what, in order:

    decode side D                                       prefill side P
    -------------                                       --------------
    1. blocks = engine.admit_remote(R)       (D allocates destination blocks first; the
                                              leading k its prefix cache holds are not sent)
    2. conn.expect(R, num_blocks)            (a payload for R may now arrive)
       ticket = conn.receiver_info() + k     → router → P
                                                        3. engine prefills R only; P holds R's blocks
                                                        4. payload = engine.export_kv(R, k)  (packed)
                                                        5. receipt = conn.send(header, payload, ticket)
                                                           P starts R's lease
                        ← router ← receipt (connector data, e.g. an object ref) + first token
    6. payload = conn.receive(R, receipt, timeout)      (verified, or a typed KVTransferError)
    7a. ok:    engine.import_kv(R); engine.finish_remote(R, ok=True)
    7b. error: engine.finish_remote(R, ok=False) → policy: recompute (default) or fail;
               conn.cancel(R); D's blocks for R are freed or reused by the recompute
    8. ack(R) → P                                       9. P releases R's blocks on ack, or when
                                                           the lease expires; late acks are counted

Ownership: P owns R's source blocks from prefill until ack or lease expiry (never longer).
D owns the destination blocks from step 1; if the transfer fails they go back to D's free
list (or stay with R when it recomputes locally). A connector never frees engine blocks; it
owns only its transport buffers and must release them (sockets, object refs, groups) in
`cancel` / `close`.

Every wait has a timeout and ends in a `KVTransferError` subclass, never a hang. Payloads
are verified against the header (layout, size, checksum; or a checksum that trails the
payload, where `checksum_trails`) before a single byte reaches the decode cache. Nothing is
ever unpickled.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from cluster.kvtransfer.errors import (KVFrameError, KVLayoutMismatchError, KVPeerGoneError,  # noqa: F401
                                       KVTimeoutError, KVTransferError, KVIntegrityError)
from cluster.kvtransfer.handoff import Receipt, Receiver
from cluster.engine.kv_layout import KVLayout
from cluster.kvtransfer.wire import KVHeader, checksum, kv_view, make_header, parse_header, sized_view
from cluster.metrics import KV_TRANSFER_BUCKETS, Histogram

DEFAULT_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Expected:
    request_id: str
    num_blocks: int


class KVConnector(ABC):
    """Moves one request's packed KV `[L, 2, n, block_size, Hkv, D]` from prefill to decode.

    Subclasses implement `_transmit` (prefill side) and `_fetch` (decode side) on raw bytes;
    this class does the header, the layout handshake, bounds, checksums and counters.
    """

    name: ClassVar[str]
    zero_copy: ClassVar[bool] = False  # receiver reads the sender's bytes without a copy
    cross_node: ClassVar[bool] = True  # works between nodes
    needs_ray: ClassVar[bool] = False
    # the checksum follows the payload (the sender computes it while the payload is on the
    # wire) instead of leading it in the header; receivers then implement `_fetch_checksum`
    checksum_trails: ClassVar[bool] = False

    def __init__(self, layout: KVLayout, *, max_payload_bytes: int = 1 << 30,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.layout = layout
        self.max_payload_bytes = max_payload_bytes
        self.timeout_s = timeout_s
        self.counters: Counter[str] = Counter()
        self.transfer_seconds = Histogram(KV_TRANSFER_BUCKETS)  # successful sends and receives
        self._expected: dict[str, Expected] = {}
        self._lock = threading.Lock()

    # -- decode side -----------------------------------------------------------------
    def receiver_info(self) -> Receiver:
        """What a sender needs to reach this receiver; always carries our layout."""
        return Receiver(self.name, self.layout, **self._receiver_address())

    def expect(self, request_id: str, num_blocks: int) -> None:
        """Announce that R's payload of `num_blocks` blocks may arrive (destination allocated)."""
        with self._lock:
            self._expected[request_id] = Expected(request_id, num_blocks)

    def is_expected(self, request_id: str) -> Expected | None:
        with self._lock:
            return self._expected.get(request_id)

    def receive(self, request_id: str, receipt: Receipt, timeout_s: float | None = None) -> torch.Tensor:
        """Block until R's payload is here and verified; returns it as a packed KV tensor."""
        expected = self.is_expected(request_id)
        if expected is None:
            raise KVFrameError(f"no transfer of {request_id!r} is expected here")
        start = time.monotonic()
        deadline = start + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            header_bytes, payload = self._fetch(expected, receipt, deadline - start)
            header = self.check_header(header_bytes, expected)
            view = sized_view(header, payload)
            actual = checksum(view)
            claimed = header.checksum
            if claimed is None:  # trailing: right behind the payload, so at least 1 s for it
                claimed = self._fetch_checksum(expected, max(deadline - time.monotonic(), 1.0))
            if actual != claimed:
                raise KVIntegrityError(f"checksum mismatch for {request_id!r}: payload corrupted")
            tensor = kv_view(header, view, self.layout)
        except KVTransferError as exc:
            self.counters[f"receive_{exc.kind}"] += 1
            raise
        finally:
            self.cancel(request_id)
        self._observe(time.monotonic() - start)
        self.counters["received"] += 1
        self.counters["received_bytes"] += header.payload_bytes
        return tensor

    def check_header(self, header_bytes: bytes, expected: Expected) -> KVHeader:
        """Parse and bound a header before anything is allocated for its payload."""
        header = parse_header(header_bytes)
        if header.layout != self.layout:
            raise KVLayoutMismatchError(
                f"KV layout mismatch: sender has {header.layout.describe()}, "
                f"this receiver has {self.layout.describe()}")
        if (header.checksum is None) != self.checksum_trails:
            where = "after the payload" if self.checksum_trails else "in the header"
            raise KVFrameError(f"header of {header.request_id!r} for connector {self.name!r}: "
                               f"its checksum must come {where}")
        if header.request_id != expected.request_id:
            raise KVFrameError(f"payload for {header.request_id!r} arrived where "
                               f"{expected.request_id!r} was expected")
        if header.payload_bytes > self.max_payload_bytes:
            raise KVFrameError(f"oversized payload: {header.payload_bytes} bytes > limit "
                               f"{self.max_payload_bytes}")
        want = self.layout.payload_bytes(expected.num_blocks)
        if header.num_blocks != expected.num_blocks or header.payload_bytes != want:
            raise KVFrameError(f"payload for {header.request_id!r} declares {header.num_blocks} blocks / "
                               f"{header.payload_bytes} bytes; expected {expected.num_blocks} / {want}")
        return header

    def cancel(self, request_id: str) -> None:
        """R is no longer expected: anything that arrives for it later is dropped and counted."""
        with self._lock:
            self._expected.pop(request_id, None)
        self._forget(request_id)

    # -- prefill side ----------------------------------------------------------------
    def send(self, request_id: str, num_tokens: int, payload: torch.Tensor,
             receiver: Receiver) -> Receipt:
        """Ship R's packed KV to `receiver` (a `receiver_info()`); returns the receipt for D."""
        theirs = receiver.layout
        if theirs != self.layout:
            self.counters["send_layout_mismatch"] += 1
            raise KVLayoutMismatchError(
                f"KV layout mismatch at handshake: this prefill side has {self.layout.describe()}, "
                f"decode side {receiver.connector} has {theirs.describe()}")
        if receiver.connector != self.name:
            raise KVTransferError(f"receiver uses connector {receiver.connector!r}, "
                                  f"this sender {self.name!r}")
        header, view = make_header(request_id, num_tokens, payload, self.layout,
                                   with_checksum=not self.checksum_trails)
        start = time.monotonic()
        try:
            receipt = self._transmit(header, view, receiver)
        except KVTransferError as exc:
            self.counters[f"send_{exc.kind}"] += 1
            raise
        self._observe(time.monotonic() - start)
        self.counters["sent"] += 1
        self.counters["sent_bytes"] += header.payload_bytes
        return receipt

    def _observe(self, seconds: float) -> None:
        with self._lock:  # receives run on several threads
            self.transfer_seconds.observe(seconds)

    # -- transport -------------------------------------------------------------------
    @abstractmethod
    def _receiver_address(self) -> dict[str, Any]:
        """Transport-specific fields of `receiver_info`'s `Receiver` (address, actor, ...)."""

    @abstractmethod
    def _transmit(self, header: KVHeader, payload: memoryview, receiver: Receiver) -> Receipt:
        """Move header + payload bytes toward the receiver; raise a KVTransferError on failure.
        Where `checksum_trails`, `header.checksum` is None: compute it after the payload has
        left and send it behind it (one given in the header is sent as the trailer instead)."""

    @abstractmethod
    def _fetch(self, expected: Expected, receipt: Receipt, timeout_s: float) -> tuple[bytes, Any]:
        """Return (header bytes, payload buffer) for `expected`; call `check_header` before
        allocating anything sized by the peer. Raise KVTimeoutError when `timeout_s` passes."""

    def _fetch_checksum(self, expected: Expected, timeout_s: float) -> int:
        """The trailing checksum of `expected`'s payload (only where `checksum_trails`);
        raise KVTimeoutError when `timeout_s` passes."""
        raise KVFrameError(f"connector {self.name!r} sends no trailing checksum")

    def _forget(self, request_id: str) -> None:
        """Drop transport state kept for R (buffers that arrived, refs); default: none."""

    def on_control(self, op: str, args: dict[str, Any]) -> Any:
        """Peer-to-peer control calls (e.g. a collective group's rendezvous), delivered by the
        hosting actor's `kv_control(op, args)` method, never by a socket of ours."""
        raise KVTransferError(f"connector {self.name!r} has no control op {op!r}")

    def stats(self) -> dict[str, int]:
        return dict(self.counters)

    def histograms(self) -> dict[str, dict[str, Any]]:
        """Seconds per successful send (prefill side) or receive (decode side: wait + verify)."""
        with self._lock:
            return {"tandem:kv_transfer_seconds": self.transfer_seconds.to_dict()}

    def close(self) -> None:
        """Release sockets, threads, groups. Idempotent."""
