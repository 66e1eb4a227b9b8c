"""The collective connector for real: gloo on CPU over loopback, between Ray actor processes.

Payloads are built inside the actors from seeds (nothing big crosses Ray); the driver checks
the receiver's sha256 against its own copy of the same deterministic tensor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time

import pytest
import ray
import ray.cloudpickle
import torch

from cluster.engine.kv_layout import KVLayout
from cluster.kvtransfer.wire import MAX_HEADER_BYTES, make_header

LAYOUT = KVLayout("tiny@0", 2, 2, 8, 4, "float32")  # 1 KiB per block
TIMEOUT_S = 5.0

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this file


def payload(seed: int, num_blocks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.payload_shape(num_blocks), generator=gen)


def digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.contiguous().numpy().tobytes()).hexdigest()


def outcome(fn):
    """("ok", value) or (error class name, message) for a KVTransferError."""
    from cluster.kvtransfer.errors import KVTransferError

    try:
        return "ok", fn()
    except KVTransferError as exc:
        return type(exc).__name__, str(exc)


@ray.remote(max_concurrency=4)
class Host:
    """One collective connector in its own process; it hosts `kv_control` for its peers."""

    def __init__(self, layout: dict | None = None, **options) -> None:
        from cluster.kvtransfer.collective import CollectiveConnector

        torch.set_num_threads(1)
        layout = KVLayout(**layout) if layout else LAYOUT
        self.conn = CollectiveConnector(layout, backend="gloo", **{"timeout_s": TIMEOUT_S, **options})

    def kv_control(self, op: str, args: dict):
        return self.conn.on_control(op, args)

    def expect(self, rid: str, num_blocks: int):
        self.conn.expect(rid, num_blocks)
        return self.conn.receiver_info()

    def send(self, rid: str, num_blocks: int, seed: int, receiver, defect: str = "none"):
        tensor = payload(seed, num_blocks)
        if defect == "none":
            return outcome(lambda: self.conn.send(rid, num_blocks * LAYOUT.block_size, tensor, receiver))
        header, view = make_header(rid, 1, tensor, LAYOUT)
        data = bytearray(view)
        if defect == "corrupt":
            data[len(data) // 2] ^= 0x40
        elif defect == "truncate":  # a well-formed header for fewer bytes than the receiver expects
            data = data[:-64]
            header = dataclasses.replace(header, payload_bytes=len(data))
        elif defect == "mismatch":  # header and bytes disagree: not frameable
            data = data[:-64]
        return outcome(lambda: self.conn._transmit(header, memoryview(data), receiver))

    def send_bogus_length(self, receiver) -> None:
        """On the cached group: a header length the receiver cannot frame."""
        link = self.conn._links[receiver.connector_id]
        self.conn._send(link, torch.tensor([MAX_HEADER_BYTES + 1]))

    def receive(self, rid: str, timeout_s: float = TIMEOUT_S):
        return outcome(lambda: digest(self.conn.receive(rid, {}, timeout_s)))

    def set_limit(self, max_payload_bytes: int) -> None:
        self.conn.max_payload_bytes = max_payload_bytes

    def stats(self) -> dict:
        return self.conn.stats()

    def pid(self) -> int:
        return os.getpid()


@pytest.fixture(scope="module")
def pair(ray_local):
    p, d = Host.remote(), Host.remote()
    ray.get([p.stats.remote(), d.stats.remote()])
    yield p, d
    for a in (p, d):
        ray.kill(a)


def kill(actor) -> None:
    """ray.kill returns before the worker process is gone: wait until it is (local cluster)."""
    pid = ray.get(actor.pid.remote())
    ray.kill(actor)
    deadline = time.monotonic() + 10
    while alive(pid):
        assert time.monotonic() < deadline, f"actor process {pid} survives ray.kill"
        time.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):  # gone before the open, or between it and the read
        return False


def transfer(p, d, rid: str, num_blocks: int, seed: int, defect: str = "none"):
    """(sender outcome, receiver outcome)."""
    receiver = ray.get(d.expect.remote(rid, num_blocks))
    sent = ray.get(p.send.remote(rid, num_blocks, seed, receiver, defect))
    return sent, ray.get(d.receive.remote(rid, TIMEOUT_S if sent[0] == "ok" else 1.0))


def assert_round_trip(p, d, rid: str, num_blocks: int = 2, seed: int = 0) -> None:
    sent, got = transfer(p, d, rid, num_blocks, seed)
    assert sent[0] == "ok", sent
    assert got == ("ok", digest(payload(seed, num_blocks)))


def test_round_trips_are_bit_exact_over_one_lazily_formed_group(pair):
    """Counters as deltas: the pair is the module's, and other tests may have used it first."""
    p, d = pair
    before, formed = ray.get(d.stats.remote()), ray.get(p.stats.remote()).get("groups_formed", 0)
    for i, n in enumerate([3, 1, 5, 3]):
        assert_round_trip(p, d, f"rt-{i}", n, seed=i)
    assert ray.get(p.stats.remote())["groups_formed"] == max(formed, 1)  # one group: formed once, then kept
    stats = ray.get(d.stats.remote())
    assert stats["received"] - before.get("received", 0) == 4
    assert stats["received_bytes"] - before.get("received_bytes", 0) == 12 * LAYOUT.block_bytes


def test_corrupted_payload_is_an_integrity_error_and_the_group_keeps_working(pair):
    p, d = pair
    checksums = ray.get(d.stats.remote()).get("receive_checksum", 0)
    sent, got = transfer(p, d, "corrupt", 2, seed=7, defect="corrupt")
    assert sent[0] == "ok"  # the bytes framed fine; only the checksum can tell
    assert got[0] == "KVIntegrityError", got
    assert ray.get(d.stats.remote())["receive_checksum"] - checksums == 1
    assert_round_trip(p, d, "after-corrupt")


def test_truncated_frame_is_refused_by_the_receiver_and_unframeable_bytes_by_the_sender(pair):
    p, d = pair
    refused = ray.get(d.stats.remote()).get("refused_frame", 0)
    sent, got = transfer(p, d, "trunc", 2, seed=1, defect="truncate")
    assert sent[0] == "KVFrameError" and "declares" in sent[1], sent
    assert got[0] == "KVFrameError" and "declares" in got[1], got
    sent, got = transfer(p, d, "mismatch", 2, seed=1, defect="mismatch")
    assert sent[0] == "KVFrameError" and "refusing to frame" in sent[1], sent
    assert got[0] == "KVTimeoutError", got  # nothing was sent
    assert ray.get(d.stats.remote())["refused_frame"] - refused == 1
    assert_round_trip(p, d, "after-trunc")


def test_oversized_payload_is_refused_before_allocation(pair):
    p, d = pair
    ray.get(d.set_limit.remote(2 * LAYOUT.block_bytes))
    try:
        sent, got = transfer(p, d, "huge", 4, seed=2)
    finally:
        ray.get(d.set_limit.remote(1 << 30))
    assert sent[0] == "KVFrameError" and "oversized" in sent[1], sent
    assert got[0] == "KVFrameError" and "oversized" in got[1], got
    formed = ray.get(p.stats.remote())["groups_formed"]
    assert_round_trip(p, d, "after-huge")  # the refusal kept the stream in sync
    assert ray.get(p.stats.remote())["groups_formed"] == formed


def test_unframeable_stream_tears_the_group_down_and_the_next_send_reforms_it(pair):
    p, d = pair
    assert_round_trip(p, d, "before-bogus")
    receiver = ray.get(d.expect.remote("unused", 1))
    before_p, before_d = ray.get(p.stats.remote()), ray.get(d.stats.remote())
    ray.get(p.send_bogus_length.remote(receiver))
    assert_round_trip(p, d, "after-bogus")
    stats = ray.get(p.stats.remote())
    assert stats["groups_formed"] == before_p["groups_formed"] + 1
    assert stats["groups_stale"] - before_p.get("groups_stale", 0) == 1
    assert ray.get(d.stats.remote())["group_ended_frame"] - before_d.get("group_ended_frame", 0) == 1


def test_unexpected_request_is_refused_and_counted(pair):
    p, d = pair
    dropped = ray.get(d.stats.remote()).get("dropped_unexpected", 0)
    receiver = ray.get(d.expect.remote("known", 1))
    sent = ray.get(p.send.remote("stranger", 1, 0, receiver))
    assert sent[0] == "KVFrameError" and "not expected" in sent[1], sent
    assert ray.get(d.stats.remote())["dropped_unexpected"] - dropped == 1
    assert_round_trip(p, d, "known", 1)


def test_receive_of_a_request_never_sent_times_out(pair):
    _, d = pair
    ray.get(d.expect.remote("never", 1))
    start = time.monotonic()
    assert ray.get(d.receive.remote("never", 1.0))[0] == "KVTimeoutError"
    assert time.monotonic() - start < 1.0 + 2.0


def test_layout_mismatch_is_refused_at_handshake_before_any_group(pair):
    p, _ = pair
    other = Host.remote(layout={**LAYOUT.to_dict(), "block_size": 8})
    try:
        formed = ray.get(p.stats.remote())["groups_formed"]
        receiver = ray.get(other.expect.remote("mm", 1))
        sent = ray.get(p.send.remote("mm", 1, 0, receiver))
        assert sent[0] == "KVLayoutMismatchError", sent
        assert "block_size 4" in sent[1] and "block_size 8" in sent[1]
        assert ray.get(p.stats.remote())["groups_formed"] == formed
        assert "groups_formed" not in ray.get(other.stats.remote())
    finally:
        ray.kill(other)


def test_peer_gone_is_a_typed_error_within_the_timeout_and_the_sender_keeps_serving(pair):
    p, d = pair
    early, late, sender = Host.remote(), Host.remote(), Host.remote()
    # a receiver killed before the first send: the join fails
    receiver = ray.get(early.expect.remote("gone", 1))
    kill(early)
    start = time.monotonic()
    assert ray.get(p.send.remote("gone", 1, 0, receiver))[0] in ("KVPeerGoneError", "KVTimeoutError")
    assert time.monotonic() - start < TIMEOUT_S + 2.0
    # a receiver killed after its group formed: the cached group fails (or re-forming does)
    assert_round_trip(p, late, "late-ok", 1)
    receiver = ray.get(late.expect.remote("late-gone", 1))
    kill(late)
    start = time.monotonic()
    assert ray.get(p.send.remote("late-gone", 1, 0, receiver))[0] in ("KVPeerGoneError", "KVTimeoutError")
    assert time.monotonic() - start < TIMEOUT_S + 2.0
    assert_round_trip(p, d, "still-serving")
    # a sender that dies: the receiver waiting for it times out
    assert_round_trip(sender, d, "from-doomed", 1)
    ray.get(d.expect.remote("orphan", 1))
    kill(sender)
    assert ray.get(d.receive.remote("orphan", 1.0))[0] == "KVTimeoutError"
    assert_round_trip(p, d, "after-orphan")


def test_receiver_info_outside_an_actor_is_a_clear_error(ray_local):
    from cluster.kvtransfer.collective import CollectiveConnector
    from cluster.kvtransfer.errors import KVTransferError

    conn = CollectiveConnector(LAYOUT, backend="gloo")
    with pytest.raises(KVTransferError, match="inside a Ray actor"):
        conn.receiver_info()
    conn.close()
    conn.close()
