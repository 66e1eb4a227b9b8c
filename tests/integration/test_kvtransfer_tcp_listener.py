"""The TCP listener against hostile peers, in-process on loopback: nothing is unpickled,
bad frames are refused and counted, and the listener keeps serving."""

from __future__ import annotations

import dataclasses
import os
import pickle

import msgpack
import pytest
import torch
import zmq

from cluster.kvtransfer.errors import KVFrameError, KVIntegrityError, KVPeerGoneError, KVTimeoutError
from cluster.kvtransfer.handoff import Receipt
from cluster.kvtransfer.tcp import MAGIC, TRAILER, TcpConnector
from cluster.engine.kv_layout import KVLayout
from cluster.kvtransfer.wire import checksum, encode_trailer, make_header

LAYOUT = KVLayout("tiny@0", 2, 2, 8, 4, "float32")


@pytest.fixture
def receiver():
    conn = TcpConnector(LAYOUT, timeout_s=3.0, max_payload_bytes=1 << 20)
    yield conn
    conn.close()


def payload(num_blocks: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYOUT.payload_shape(num_blocks), generator=torch.Generator().manual_seed(seed))


def raw_send(address: str, frames: list[bytes]) -> dict:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        assert sock.poll(3000), "the listener must answer"
        return msgpack.unpackb(sock.recv())
    finally:
        sock.close(0)


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_frames_are_refused_and_never_executed(receiver, tmp_path):
    marker = tmp_path / "pwned"
    _Exploit.marker = str(marker)
    evil = pickle.dumps(_Exploit())
    address = receiver.receiver_info().address
    receiver.expect("r1", 3)

    assert raw_send(address, [evil])["ok"] is False  # a lone pickle
    reply = raw_send(address, [MAGIC, evil, evil])  # a pickle where the header goes
    assert reply["ok"] is False and reply["kind"] == "frame"
    reply = raw_send(address, [TRAILER, evil])  # a pickle where the checksum goes
    assert reply["ok"] is False and reply["kind"] == "frame"
    assert not marker.exists()
    assert receiver.stats()["refused_bad_frame"] == 1 and receiver.stats()["refused_frame"] == 2

    # and it still serves a real transfer
    sender = TcpConnector(LAYOUT, timeout_s=3.0, listen=False)
    try:
        kv = payload()
        sender.send("r1", 10, kv, receiver.receiver_info())
        assert torch.equal(receiver.receive("r1", Receipt()), kv)
    finally:
        sender.close()


def test_unexpected_oversized_and_unreachable(receiver):
    address = receiver.receiver_info().address
    header, view = make_header("nobody", 10, payload(), LAYOUT)
    reply = raw_send(address, [MAGIC, header.encode(), bytes(view)])
    assert reply["ok"] is False and receiver.stats()["dropped_unexpected"] == 1

    sender = TcpConnector(LAYOUT, timeout_s=2.0, listen=False)
    try:
        # a frame over ZMQ_MAXMSGSIZE: libzmq drops it (and the connection) before allocating
        receiver.expect("big", 3)
        with pytest.raises(KVTimeoutError):
            sender.transmit_frames(address, [MAGIC, header.encode(), b"\0" * ((1 << 20) + 1)])
        with pytest.raises(KVTimeoutError):
            receiver.receive("big", Receipt(), timeout_s=0.5)
        # nobody listens here
        with pytest.raises(KVPeerGoneError):
            sender.send("x", 10, payload(), dataclasses.replace(receiver.receiver_info(), address="tcp://127.0.0.1:9"))
        # the listener is still fine
        receiver.expect("ok", 3)
        kv = payload(seed=1)
        sender.send("ok", 10, kv, receiver.receiver_info())
        assert torch.equal(receiver.receive("ok", Receipt()), kv)
    finally:
        sender.close()


def _wire_header(rid: str, kv: torch.Tensor):
    """The header a TCP sender puts on the wire (checksum nil: it trails) and the true checksum."""
    header, view = make_header(rid, 10, kv, LAYOUT, with_checksum=False)
    return header.encode(), bytes(view), checksum(view)


def test_the_checksum_trails_the_payload_and_is_checked(receiver):
    """A payload is kept only with its own trailer: a wrong one fails the transfer, a missing
    one times out, a stray one is refused; the listener serves on after each."""
    address = receiver.receiver_info().address
    kv = payload(seed=2)
    head, body, good = _wire_header("wrong", kv)
    receiver.expect("wrong", 3)
    assert raw_send(address, [MAGIC, head, body])["ok"] is True
    assert raw_send(address, [TRAILER, encode_trailer("wrong", good ^ 1)])["ok"] is True
    with pytest.raises(KVIntegrityError):
        receiver.receive("wrong", Receipt(), timeout_s=2.0)

    head, body, good = _wire_header("lost", kv)
    receiver.expect("lost", 3)
    assert raw_send(address, [MAGIC, head, body])["ok"] is True
    with pytest.raises(KVTimeoutError, match="checksum"):  # the sender died before its trailer
        receiver.receive("lost", Receipt(), timeout_s=1.0)
    late = raw_send(address, [TRAILER, encode_trailer("lost", good)])  # after receive gave up
    stray = raw_send(address, [TRAILER, encode_trailer("nobody", good)])
    assert late["ok"] is False and stray["ok"] is False
    assert receiver.stats()["dropped_trailer"] == 2

    # a header that carries its checksum skips the trailer: this connector refuses it
    header, view = make_header("leading", 10, kv, LAYOUT)
    receiver.expect("leading", 3)
    reply = raw_send(address, [MAGIC, header.encode(), bytes(view)])
    assert reply["ok"] is False and "after the payload" in reply["error"]
    with pytest.raises(KVFrameError):
        receiver.receive("leading", Receipt(), timeout_s=1.0)

    sender = TcpConnector(LAYOUT, timeout_s=3.0, listen=False)
    try:
        receiver.expect("ok", 3)
        sender.send("ok", 10, kv, receiver.receiver_info())
        assert torch.equal(receiver.receive("ok", Receipt()), kv)
    finally:
        sender.close()
    assert receiver._mailbox.pending() == 0 and receiver._sums.pending() == 0
    assert not receiver._awaiting_sum


def test_a_sender_that_fails_between_payload_and_trailer_starts_afresh(receiver):
    """Replies still owed for the broken transfer must never be read as a later one's."""
    address = receiver.receiver_info().address
    kv = payload(seed=3)
    sender = TcpConnector(LAYOUT, timeout_s=3.0, listen=False)
    try:
        head, body, good = _wire_header("broken", kv)
        receiver.expect("broken", 3)
        with pytest.raises(ZeroDivisionError):  # the trailer could not be made
            sender.transmit_frames(address, [MAGIC, head, body], lambda: 1 / 0)
        receiver.cancel("broken")

        receiver.expect("next", 3)
        sender.send("next", 10, kv, receiver.receiver_info())
        assert torch.equal(receiver.receive("next", Receipt()), kv)
        head, body, good = _wire_header("last", kv)
        receiver.expect("last", 3)
        with pytest.raises(KVFrameError, match="awaits a checksum"):  # its own verdict, not a stale one
            sender.transmit_frames(address, [MAGIC, head, body], [TRAILER, encode_trailer("other", good)])
    finally:
        sender.close()


def test_header_parsing_is_bounded_and_typed():
    from cluster.kvtransfer.wire import MAX_HEADER_BYTES, parse_header, parse_trailer

    header, _ = make_header("r", 5, payload(1), LAYOUT)
    assert parse_header(header.encode()) == header
    for bad in (b"", b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"v": 99}),
                msgpack.packb({"v": 1, "request_id": "r"}), b"\x81" + b"\xa1a" * 3,
                msgpack.packb({**msgpack.unpackb(header.encode()), "num_blocks": -1}),
                msgpack.packb({**msgpack.unpackb(header.encode()), "checksum": "x"}),
                msgpack.packb({**msgpack.unpackb(header.encode()), "v": 1}),
                b"x" * (MAX_HEADER_BYTES + 1)):
        with pytest.raises(KVFrameError):
            parse_header(bad)
    trailing, _ = make_header("r", 5, payload(1), LAYOUT, with_checksum=False)
    assert parse_header(trailing.encode()).checksum is None
    for bad in (b"\xc1", msgpack.packb({"request_id": "r"}), msgpack.packb({"request_id": 1, "checksum": 2}),
                msgpack.packb({"request_id": "r", "checksum": -1}), b"x" * (MAX_HEADER_BYTES + 1)):
        with pytest.raises(KVFrameError):
            parse_trailer(bad)


def test_a_connector_whose_checksum_leads_refuses_a_header_without_one():
    """Else a sender could skip verification by leaving the checksum out."""
    from cluster.kvtransfer.base import Expected
    from cluster.kvtransfer.collective import CollectiveConnector

    conn = CollectiveConnector(LAYOUT, backend="gloo")
    try:
        trailing, _ = make_header("r", 5, payload(1), LAYOUT, with_checksum=False)
        with pytest.raises(KVFrameError, match="in the header"):
            conn.check_header(trailing.encode(), Expected("r", 1))
    finally:
        conn.close()
