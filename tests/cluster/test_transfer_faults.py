"""KV transfers that break on the wire (reliability faults 6 and 7), on a local Ray with real
processes and real sockets. The decode replica's TCP listener is reached through a relay
(faulty_link.py; the decode side advertises the relay's port) that breaks the next KV message:
  - reset, truncation or a stall mid-message: the prefill side's send ends in a typed error
    within `timeout_s` (no verdict came back), never a hang; the request takes the failure
    policy (recompute: the decode replica prefills the prompt itself, same greedy text); the
    listener keeps serving, and a message that arrives late is dropped and counted
  - the client hangs up while its KV is in flight: the decode replica frees its reserved
    blocks within 1 s (a transfer lands in the connector's own buffer, never in them); the
    prefill replica keeps the request's blocks until the transfer has ended; nothing crashes
    and a request admitted meanwhile gets its exact text."""

from __future__ import annotations

import threading
import time

import pytest

from faulty_link import FaultyLink
from serving import client, deploy, free_port, hang_up, open_stream, replica_stats, settled, wait_for

pytestmark = pytest.mark.slow

TIMEOUT_S = 4.0  # the connector's bound on every wait
PROMPT = "Write down the shelves: " + " ".join(f"item{i} on shelf {i % 5}" for i in range(60))


@pytest.fixture(scope="module")
def link(serve_url, tiny_model_paths):
    port = free_port()
    relay = FaultyLink(port)
    deploy({"model": str(tiny_model_paths["llama"]), "served_model_name": "tiny", "engine": {"num_blocks": 64},
            "kv_transfer": {"connector": "tcp", "port": port, "advertise_port": relay.port,
                            "timeout_s": TIMEOUT_S}})
    yield relay
    relay.close()


def ask(url: str, content: str = PROMPT, max_tokens: int = 12) -> str:
    r = client(url).chat.completions.create(model="tiny", temperature=0, max_tokens=max_tokens,
                                            extra_body={"ignore_eos": True},
                                            messages=[{"role": "user", "content": content}])
    assert r.choices[0].finish_reason == "length"
    return r.choices[0].message.content


def pools(url: str) -> dict[str, dict]:
    return {s["pool"]: s for s in replica_stats(url)}


def grew(before: dict, after: dict, key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


@pytest.mark.parametrize("mode", ["reset", "truncate", "stall"])
def test_a_transfer_broken_on_the_wire_takes_the_failure_policy(link, serve_url, mode):
    expected = ask(serve_url)  # its KV crossed the link intact
    before = pools(serve_url)
    link.arm(mode, hold_s=TIMEOUT_S + 1.5)
    start = time.monotonic()
    got = ask(serve_url)
    assert link.broken.is_set()
    assert time.monotonic() - start < TIMEOUT_S + 8  # bounded by the send's verdict wait, no hang
    assert got == expected  # the decode replica recomputed the prompt: the same greedy text
    after = settled(serve_url)
    p, d = after["prefill"], after["decode"]
    assert grew(before["prefill"], p, "kv_send_timeout") == 1 and grew(before["prefill"], p, "send_failed") == 1
    assert grew(before["decode"], d, "prefill_failed") == 1 and grew(before["decode"], d, "recomputed") == 1
    for s in (p, d):
        assert s["blocks_in_use"] == 0 and s["num_running"] == 0 and s.get("leases", 0) == 0, s
        assert s["pid"] == before[s["pool"]]["pid"]  # nobody crashed
    if mode == "stall":  # the held half arrives after the sender gave up: dropped, counted
        assert link.released.wait(TIMEOUT_S + 5)
        wait_for(lambda: grew(before["decode"], pools(serve_url)["decode"], "kv_dropped_unexpected") == 1, 10,
                 "the late message to be dropped")
    # the listener still takes KV: the next request's lands
    landed = pools(serve_url)["decode"]["kv_landed"]
    assert ask(serve_url) == expected
    assert pools(serve_url)["decode"]["kv_landed"] == landed + 1


def test_abort_while_the_kv_is_in_flight_frees_nothing_early_and_crashes_nothing(link, serve_url):
    other = "Name three colours of the sea."
    expected = ask(serve_url, other)
    before = pools(serve_url)
    link.arm("stall", hold_s=2.5)
    conn = open_stream(serve_url, PROMPT, 16, model="tiny")
    assert link.broken.wait(30), "the KV never reached the link"
    t = hang_up(conn)
    # a request admitted while the aborted one's KV is still in flight (the decode side may
    # hand it the blocks just freed; its own KV queues behind the stalled message)
    result: dict[str, str] = {}
    later = threading.Thread(target=lambda: result.setdefault("text", ask(serve_url, other)))
    later.start()
    deadline = time.monotonic() + 10
    while (during := pools(serve_url))["decode"]["last_abort_at"] <= t:  # each read a fresh post
        assert time.monotonic() < deadline, "the decode replica never freed the aborted request"
    assert not link.released.is_set(), "the stall ended before the checks"
    d = during["decode"]
    assert d["last_abort_at"] <= t + 1.0, d["last_abort_at"] - t  # freed at once: nothing lands there
    assert during["prefill"]["blocks_in_use"] > 0  # the transfer's source is still held
    assert link.released.wait(10)
    later.join(timeout=60)
    assert result.get("text") == expected
    after = settled(serve_url)
    p, d = after["prefill"], after["decode"]
    assert p["last_abort_at"] > link.released_at  # the prefill side freed R only after the transfer ended
    assert grew(before["prefill"], p, "cancelled") == 1
    assert grew(before["decode"], d, "kv_dropped_unexpected") == 1  # the aborted request's KV, late
    for s in (p, d):
        assert s["blocks_in_use"] == 0 and s["num_running"] == 0 and s.get("leases", 0) == 0, s
        assert s["pid"] == before[s["pool"]]["pid"]
