"""The prefill side's lease (prefill/exporter.py): what a hand-off's receipt refers to (a
shared_store object of R's KV, owned by the prefill process) lives as long as R's blocks are
held for the decode side, and no longer."""

from __future__ import annotations

import gc
import weakref

from cluster.kvtransfer.handoff import Receipt
from cluster.prefill.exporter import KVExporter


class FakeEngine:
    def __init__(self) -> None:
        self.released: list[str] = []

    def release(self, request_id: str) -> None:
        self.released.append(request_id)

    def abort_request(self, request_id: str) -> bool:
        self.released.append(request_id)
        return True


class StoredKV:
    """Stands in for an ObjectRef: alive while someone holds it."""


def leased(exporter: KVExporter, rid: str) -> weakref.ref:
    obj = StoredKV()
    exporter.lease(rid, Receipt(b"header", obj))
    ref = weakref.ref(obj)
    del obj
    gc.collect()
    return ref


def test_a_leased_receipt_is_held_until_the_ack_and_let_go_with_the_blocks():
    clock = [0.0]
    engine = FakeEngine()
    exporter = KVExporter(engine, connector=None, lease_s=30.0, clock=lambda: clock[0])

    acked, expired, dropped = (leased(exporter, rid) for rid in ("acked", "expired", "dropped"))
    assert acked() is not None and expired() is not None and dropped() is not None  # nobody else holds them

    assert exporter.ack("acked")
    gc.collect()
    assert acked() is None and engine.released == ["acked"]

    exporter.drop("dropped")  # R's caller went away
    gc.collect()
    assert dropped() is None and expired() is not None

    clock[0] = 31.0
    assert exporter.reap() == ["expired"]  # the decode side never acknowledged it
    gc.collect()
    assert expired() is None and engine.released == ["acked", "dropped", "expired"]
    assert not exporter.leases
