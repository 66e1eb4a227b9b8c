"""TCP connector: pyzmq DEALER (prefill) → ROUTER (decode), msgpack headers, raw payload frames.

    prefill DEALER ── [b"TKV2", header (msgpack, checksum nil), payload (raw, zero-copy)] ──▶ decode ROUTER
                   ── [b"TKV2S", trailer (msgpack {request_id, checksum})] ──────────────────▶
                   ◀── one reply per message (msgpack {"ok": bool, "kind": str, "error": str})

The checksum trails the payload: the sender hands the payload to libzmq's I/O thread first and
computes the checksum while it is on the wire (wire.py says what that saves). The decode side
listens on `host:port` (loopback and a free port by default) and advertises the address in
`receiver_info`. Its listener thread checks every header before keeping a payload, and keeps
a trailer only for a payload it kept; `receive` verifies the checksum. Bounds: libzmq drops
any frame over `max_payload_bytes` (ZMQ_MAXMSGSIZE) before allocating it and closes that
connection; the sender sees a typed timeout. Senders use ZMQ_IMMEDIATE, so an unreachable
peer is a KVPeerGoneError, not a queued message.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

import msgpack
import zmq

from cluster.kvtransfer import errors
from cluster.kvtransfer.base import Expected, KVConnector
from cluster.kvtransfer.handoff import Receipt, Receiver
from cluster.kvtransfer.errors import KVFrameError, KVPeerGoneError, KVTimeoutError, KVTransferError
from cluster.kvtransfer.mailbox import Mailbox
from cluster.engine.kv_layout import KVLayout
from cluster.kvtransfer.wire import (MAX_HEADER_BYTES, KVHeader, checksum, encode_trailer, parse_header,
                                     parse_trailer)

MAGIC = b"TKV2"  # header + payload
TRAILER = b"TKV2S"  # the payload's checksum, right behind it
_ERRORS = {cls.kind: cls for cls in (errors.KVTimeoutError, errors.KVLayoutMismatchError,
                                      errors.KVIntegrityError, errors.KVFrameError,
                                      errors.KVPeerGoneError)}


class TcpConnector(KVConnector):
    name = "tcp"
    zero_copy = False
    cross_node = True
    checksum_trails = True

    def __init__(self, layout: KVLayout, *, max_payload_bytes: int = 1 << 30, timeout_s: float = 30.0,
                 host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None,
                 advertise_port: int | None = None, listen: bool = True) -> None:
        super().__init__(layout, max_payload_bytes=max_payload_bytes, timeout_s=timeout_s)
        self._ctx = zmq.Context()
        self._mailbox = Mailbox()  # request id -> (header bytes, payload)
        self._sums = Mailbox()  # request id -> trailing checksum
        self._awaiting_sum: set[str] = set()  # payload kept, trailer not here yet
        self._senders: dict[str, zmq.Socket] = {}
        self._send_lock = threading.Lock()
        self._stop = threading.Event()
        self._address: str | None = None
        self._thread: threading.Thread | None = None
        if listen:
            self._listen(host, port, advertise_host or host, advertise_port)

    # -- decode side -----------------------------------------------------------------
    def _listen(self, host: str, port: int, advertise: str, advertise_port: int | None) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, max(self.max_payload_bytes, MAX_HEADER_BYTES))
        sock.setsockopt(zmq.LINGER, 0)
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            port = sock.bind_to_random_port(f"tcp://{host}")
        self._address = f"tcp://{advertise}:{advertise_port or port}"
        self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                        name=f"tandem-kv-tcp-{port}")
        self._thread.start()

    def _serve(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = sock.recv_multipart(copy=False)
                reply = self._accept(frames[1:])
                sock.send_multipart([frames[0].bytes, msgpack.packb(reply)])
                del frames  # the mailbox holds what it kept; nothing else outlives the message
        finally:
            sock.close(0)

    def _accept(self, frames: list[zmq.Frame]) -> dict[str, Any]:
        """Check one incoming message; keep its payload (or trailer) for `receive` or say why not."""
        if len(frames) == 2 and frames[0].bytes == TRAILER:
            return self._accept_trailer(frames[1])
        if len(frames) != 3 or frames[0].bytes != MAGIC:
            self.counters["refused_bad_frame"] += 1
            return {"ok": False, "kind": "frame", "error": "not a Tandem KV message"}
        header_frame, payload = frames[1], frames[2]
        try:
            if len(header_frame) > MAX_HEADER_BYTES:
                raise KVFrameError(f"oversized header: {len(header_frame)} bytes")
            header = parse_header(header_frame.bytes)
        except KVTransferError as exc:
            self.counters[f"refused_{exc.kind}"] += 1
            return {"ok": False, "kind": exc.kind, "error": str(exc)}
        expected = self.is_expected(header.request_id)
        if expected is None:
            self.counters["dropped_unexpected"] += 1
            return {"ok": False, "kind": "frame", "error": f"{header.request_id!r} is not expected here"}
        try:
            self.check_header(header_frame.bytes, expected)
        except KVTransferError as exc:
            self.counters[f"refused_{exc.kind}"] += 1
            self._mailbox.fail(header.request_id, exc)
            return {"ok": False, "kind": exc.kind, "error": str(exc)}
        with self._lock:
            self._awaiting_sum.add(header.request_id)
        self._post(self._mailbox, header.request_id, (header_frame.bytes, payload.buffer))
        return {"ok": True}

    def _accept_trailer(self, frame: zmq.Frame) -> dict[str, Any]:
        try:
            request_id, value = parse_trailer(frame.bytes)
        except KVTransferError as exc:
            self.counters[f"refused_{exc.kind}"] += 1
            return {"ok": False, "kind": exc.kind, "error": str(exc)}
        with self._lock:
            kept = request_id in self._awaiting_sum
            self._awaiting_sum.discard(request_id)
        if not kept:  # its payload was refused, or the request is gone
            self.counters["dropped_trailer"] += 1
            return {"ok": False, "kind": "frame", "error": f"no payload of {request_id!r} awaits a checksum"}
        self._post(self._sums, request_id, value)
        return {"ok": True}

    def _post(self, box: Mailbox, request_id: str, item: Any) -> None:
        box.deliver(request_id, item)
        if self.is_expected(request_id) is None:  # cancelled while it was in flight
            self._forget(request_id)
            self.counters["dropped_late"] += 1

    def _receiver_address(self) -> dict[str, Any]:
        if self._address is None:
            raise KVTransferError("this TCP connector does not listen (listen=False)")
        return {"address": self._address}

    def _fetch(self, expected: Expected, receipt: Receipt, timeout_s: float) -> tuple[bytes, Any]:
        return self._mailbox.wait(expected.request_id, timeout_s)

    def _fetch_checksum(self, expected: Expected, timeout_s: float) -> int:
        return self._sums.wait(expected.request_id, timeout_s, what="the checksum")

    def _forget(self, request_id: str) -> None:
        with self._lock:
            self._awaiting_sum.discard(request_id)
        self._mailbox.discard(request_id)
        self._sums.discard(request_id)

    # -- prefill side ----------------------------------------------------------------
    def _transmit(self, header: KVHeader, payload: memoryview, receiver: Receiver) -> Receipt:
        def trailer() -> list[bytes]:  # runs once the payload is queued for libzmq's I/O thread
            value = checksum(payload) if header.checksum is None else header.checksum
            return [TRAILER, encode_trailer(header.request_id, value)]

        head = dataclasses.replace(header, checksum=None).encode()
        return self.transmit_frames(receiver.address, [MAGIC, head, payload], trailer)

    def transmit_frames(self, address: str, *messages: list[Any] | Callable[[], list[Any]]) -> Receipt:
        """Send messages in order (lists of frames, or callables that make one when its turn
        comes), then wait for the listener's verdict on each; the first refusal raises. Also
        the fault tests' hook."""
        deadline = time.monotonic() + self.timeout_s
        with self._send_lock:
            sock = self._sender(address)
            try:
                replies = self._exchange(sock, address, messages, deadline)
            except BaseException:
                self._drop_sender(address)  # a reply may still be on its way: never read it later
                raise
        for reply in replies:
            if not isinstance(reply, dict) or not reply.get("ok"):
                kind = reply.get("kind") if isinstance(reply, dict) else "frame"
                raise _ERRORS.get(kind, KVTransferError)(f"{address} refused the KV: {reply}")
        return Receipt()

    def _exchange(self, sock: zmq.Socket, address: str, messages: tuple, deadline: float) -> list[Any]:
        for message in messages:
            try:
                sock.send_multipart(message() if callable(message) else message, copy=False)
            except zmq.Again:
                raise KVPeerGoneError(f"no connection to {address} within {self.timeout_s:.1f}s") from None
        replies = []
        for _ in messages:
            if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise KVTimeoutError(f"no reply from {address} within {self.timeout_s:.1f}s "
                                     "(peer gone, or the frame exceeded its size limit)")
            replies.append(msgpack.unpackb(sock.recv()[:MAX_HEADER_BYTES], raw=False,
                                           max_bin_len=0, max_ext_len=0))
        return replies

    def _sender(self, address: str) -> zmq.Socket:
        sock = self._senders.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing toward a peer that isn't connected
            sock.setsockopt(zmq.SNDTIMEO, int(self.timeout_s * 1000))
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._senders[address] = sock
        return sock

    def _drop_sender(self, address: str) -> None:
        """After a failure the socket may hold a stale reply: start fresh next time."""
        sock = self._senders.pop(address, None)
        if sock is not None:
            sock.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None
        with self._send_lock:
            for address in list(self._senders):
                self._drop_sender(address)
        if not self._ctx.closed:
            self._ctx.term()
