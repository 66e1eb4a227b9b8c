"""Every connector for real, between two Ray actor processes, each with its own engine.

shared_store: the local Ray object store. tcp: loopback sockets. collective: gloo on CPU.
"""

from __future__ import annotations

import time

import pytest

from cluster import SamplingParams
from cluster.kvtransfer.errors import KVFrameError, KVIntegrityError
from cluster.kvtransfer.handoff import Receipt

CONNECTORS = ["shared_store", "tcp", "collective"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SMALL_ENGINE = {"cpu_kv_cache_bytes": 1 << 24, "enable_prefix_caching": False}
SHORT = {"timeout_s": 5.0}


def prompts() -> list[list[int]]:
    return [[1, 504, 3156, 314, 2683, 42], list(range(2000, 2037)), list(range(5000, 5100))]


def hosts(ray, connector, model, *each: dict):
    """One KVHost per dict of its options (engine_args, connector_options, lease_s, policy),
    started together (each takes seconds to start a process and load its engine); returned
    once all of them are up."""
    from kv_host import KVHost

    actors = [KVHost.remote(connector, str(model) if model else None, options.pop("engine_args", SMALL_ENGINE),
                            {**SHORT, **options.pop("connector_options", {})}, **options)
              for options in map(dict, each)]
    ray.get([a.pid.remote() for a in actors])
    return actors


def blocks_in_use(ray, *actors) -> list[int]:
    return [ray.get(a.stats.remote())["blocks_in_use"] for a in actors]


@pytest.fixture(scope="module", params=CONNECTORS)
def connector(request) -> str:
    """Each connector's tests run together (module-scoped), sharing its hosts (`shared`)."""
    return request.param


@pytest.fixture(scope="module")
def shared(connector, ray_local, tiny_model_paths):
    """(prefill host, decode host, decode host with prefix caching) over `connector` on the tiny
    Llama, shared by the module's tests of that connector (each host takes seconds to start) and
    stopped before the next connector's; a test that changes a host's settings sets them back,
    one that kills a host starts its own."""
    actors = hosts(ray_local, connector, tiny_model_paths["llama"], {}, {},
                   {"engine_args": {"cpu_kv_cache_bytes": 1 << 24}})
    yield actors
    for a in actors:
        ray_local.kill(a)


@pytest.fixture(scope="module")
def pair(connector, shared):
    """(connector, prefill host, decode host)."""
    return connector, shared[0], shared[1]


def grown(ray, actor, before: dict):
    """Counter → how much it grew on `actor` since `before` (its stats then)."""
    after = ray.get(actor.stats.remote())
    return lambda key: after.get(key, 0) - before.get(key, 0)


def reaped_once_expired(ray, p, timeout_s: float = 10.0) -> list[str]:
    """Poll the prefill host's reaper until it frees something (its lease ran out)."""
    deadline = time.monotonic() + timeout_s
    while not (reaped := ray.get(p.reap.remote())):
        assert time.monotonic() < deadline, f"nothing reaped within {timeout_s} s"
        time.sleep(0.05)
    return reaped


def handoff(ray, p, d, rid, prompt, params=GREEDY):
    receiver = ray.get(d.reserve.remote(rid, prompt, params))
    assert receiver is not None
    return ray.get(p.prefill.remote(rid, prompt, params, receiver))


def test_round_trip_is_bit_exact(pair, ray_local):
    ray = ray_local
    _, p, d = pair
    for i, prompt in enumerate(prompts()):
        rid = f"rt-{i}"
        receiver = ray.get(d.reserve.remote(rid, prompt, GREEDY))
        sent_sha = ray.get(p.prefill_and_hold.remote(rid, prompt, GREEDY))
        receipt = ray.get(p.send_raw.remote(rid, receiver, "none"))
        landed_sha = ray.get(d.imported_sha.remote(rid, receipt))
        assert landed_sha == sent_sha
    assert blocks_in_use(ray, p, d) == [0, 0]


@pytest.mark.slow
def test_transferred_kv_decodes_like_colocated_on_the_default_model(connector, ray_local, default_model_path):
    ray = ray_local
    engine_args = {"cpu_kv_cache_bytes": 1 << 26, "enable_prefix_caching": False}  # every block crosses
    p, d = hosts(ray, connector, None, {"engine_args": engine_args}, {"engine_args": engine_args})
    try:
        for i, prompt in enumerate(prompts()):
            rid = f"gd-{i}"
            colocated = ray.get(d.generate_local.remote(prompt, GREEDY))
            h = handoff(ray, p, d, rid, prompt)
            assert ray.get(d.start.remote(rid, h)) == colocated
            assert ray.get(p.ack.remote(rid))
        stats = ray.get(d.stats.remote())
        assert stats["kv_landed"] == 3 and "recomputed" not in stats
        assert blocks_in_use(ray, p, d) == [0, 0]
    finally:
        for a in (p, d):
            ray.kill(a)


def test_blocks_the_decode_side_holds_are_not_sent_again(connector, ray_local, shared):
    """A conversation's next turn on the same decode replica: only its new blocks cross."""
    ray = ray_local
    p, _, d = shared  # d: prefix caching on (its cache holds only this test's prompts)
    before = ray.get(d.stats.remote())
    first = prompts()[2]  # 100 tokens: 7 blocks of 16
    h = handoff(ray, p, d, "turn1", first)
    ray.get(d.start.remote("turn1", h))
    ray.get(p.ack.remote("turn1"))
    block_bytes = h.kv_bytes // 7
    following = first[:90] + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]  # 105: 7 blocks
    colocated = ray.get(p.generate_local.remote(following, GREEDY))  # p caches nothing
    h2 = handoff(ray, p, d, "turn2", following)
    assert h2.kv_bytes == 2 * block_bytes  # blocks 0-4 (tokens 0-79) are already on d
    assert ray.get(d.start.remote("turn2", h2)) == colocated
    ray.get(p.ack.remote("turn2"))
    grew = grown(ray, d, before)
    assert grew("kv_reused_blocks") == 5 and grew("kv_landed") == 2 and grew("recomputed") == 0
    assert blocks_in_use(ray, p, d) == [0, 0]


@pytest.mark.parametrize("mode,error", [
    ("corrupt", KVIntegrityError),
    ("truncate", KVFrameError),
    ("pad", KVFrameError),
    ("declare_huge", KVFrameError),
])
def test_bad_payloads_are_refused_counted_and_the_engines_keep_serving(pair, ray_local, mode, error):
    """The receiver refuses the payload with the named error and counts it under the error's
    kind. The collective connector's sender will not frame bytes its header misstates (the
    stream could not be framed after them): there the named error comes from the sender and
    nothing crosses, so the receiver's wait ends empty."""
    ray = ray_local
    connector, p, d = pair
    prompt = prompts()[1]
    rid = f"bad-{mode}"
    before = ray.get(d.stats.remote())
    receiver = ray.get(d.reserve.remote(rid, prompt, GREEDY))
    ray.get(p.prefill_and_hold.remote(rid, prompt, GREEDY))
    unframeable = connector == "collective" and mode != "corrupt"
    try:
        receipt = ray.get(p.send_raw.remote(rid, receiver, mode))
        refused_on_the_spot = None
    except Exception as exc:  # tcp's listener replies with its verdict; the collective sender checks first
        refused_on_the_spot = repr(exc)
        receipt = Receipt()
    if unframeable or refused_on_the_spot:
        assert refused_on_the_spot and error.__name__ in refused_on_the_spot, refused_on_the_spot
    got = ray.get(d.receive_error.remote(rid, receipt, 1.0 if unframeable else 5.0))
    after = ray.get(d.stats.remote())

    def grew(key: str) -> int:
        return after.get(key, 0) - before.get(key, 0)

    assert grew("kv_received") == 0
    if unframeable:
        assert got is not None and got.startswith("KVTimeoutError"), got
        assert grew("kv_receive_timeout") == 1
    else:
        assert got is not None and got.startswith(error.__name__), got
        assert grew(f"kv_receive_{error.kind}") == 1
    # still serving: a clean hand-off right after gives the colocated tokens
    colocated = ray.get(d.generate_local.remote(prompt, GREEDY))
    h = handoff(ray, p, d, f"after-{mode}", prompt)
    assert ray.get(d.start.remote(f"after-{mode}", h)) == colocated
    ray.get(p.ack.remote(f"after-{mode}"))
    assert blocks_in_use(ray, p, d) == [0, 0]


def test_unacknowledged_kv_is_freed_when_the_lease_expires(connector, ray_local, shared):
    ray = ray_local
    p, d, _ = shared
    before = ray.get(p.stats.remote())
    ray.get(p.configure.remote(lease_s=1.0))
    try:
        h = handoff(ray, p, d, "lease", prompts()[2])
        assert blocks_in_use(ray, p)[0] > 0
        assert ray.get(p.reap.remote()) == []  # not before its lease is out
        assert reaped_once_expired(ray, p) == ["lease"]
        assert not ray.get(p.ack.remote("lease"))  # late: ignored, counted
        grew = grown(ray, p, before)
        assert grew("lease_expired") == 1 and grew("late_acks") == 1 and blocks_in_use(ray, p) == [0]
        ray.get(d.start.remote("lease", h))  # the decode side still gets its tokens
        assert blocks_in_use(ray, d) == [0]
    finally:
        ray.get(p.configure.remote(lease_s=30.0))


def test_layout_mismatch_is_refused_at_handshake_naming_both_sides(connector, ray_local, shared, tiny_model_paths):
    ray = ray_local
    p = shared[0]
    (d,) = hosts(ray, connector, tiny_model_paths["llama"], {"engine_args": {**SMALL_ENGINE, "block_size": 8}})
    try:
        prompt = prompts()[1]
        receiver = ray.get(d.reserve.remote("mm", prompt, GREEDY))
        with pytest.raises(Exception, match=r"KVLayoutMismatchError.*block_size 16.*block_size 8"):
            ray.get(p.prefill.remote("mm", prompt, GREEDY, receiver))
        colocated = ray.get(d.generate_local.remote(prompt, GREEDY))
        assert ray.get(d.abandon.remote("mm")) == colocated  # decode recomputes (default policy)
        assert blocks_in_use(ray, p, d) == [0, 0]
    finally:
        ray.kill(d)


def test_peer_gone_before_and_after_send(connector, ray_local, tiny_model_paths):
    ray = ray_local
    model = tiny_model_paths["llama"]
    prompt = prompts()[1]
    p, d, d2 = hosts(ray, connector, model, {"lease_s": 1.0}, {}, {})
    try:
        # before: the decode actor dies after reserving, before the prefill sends
        receiver = ray.get(d.reserve.remote("gone1", prompt, GREEDY))
        ray.kill(d)
        try:
            ray.get(p.prefill.remote("gone1", prompt, GREEDY, receiver))
            sent = True  # the object store accepts a put without a live reader
        except Exception as exc:
            assert "KVPeerGoneError" in repr(exc) or "KVTimeoutError" in repr(exc), repr(exc)
            sent = False
        if sent:
            assert reaped_once_expired(ray, p) == ["gone1"]
        assert blocks_in_use(ray, p) == [0]

        # after: the prefill actor dies once the KV is sent; decode still finishes the request
        colocated = ray.get(d2.generate_local.remote(prompt, GREEDY))
        h = handoff(ray, p, d2, "gone2", prompt)
        ray.kill(p)
        assert ray.get(d2.start.remote("gone2", h)) == colocated  # landed, or recomputed
        assert blocks_in_use(ray, d2) == [0]
    finally:
        for a in (p, d, d2):
            ray.kill(a)


@pytest.mark.parametrize("connector", ["tcp", "shared_store"], indirect=True)
def test_failure_policy_fail_ends_the_request_with_the_typed_error(connector, ray_local, shared):
    from cluster.kvtransfer.handoff import PrefillHandoff

    ray = ray_local
    p, d, _ = shared
    before = ray.get(d.stats.remote())
    ray.get(d.configure.remote(policy="fail"))
    try:
        prompt = prompts()[1]
        receiver = ray.get(d.reserve.remote("f", prompt, GREEDY))
        ray.get(p.prefill_and_hold.remote("f", prompt, GREEDY))
        receipt = ray.get(p.send_raw.remote("f", receiver, "corrupt"))
        with pytest.raises(Exception, match="KVIntegrityError"):
            ray.get(d.start.remote("f", PrefillHandoff("f", 5, None, receipt)))
        grew = grown(ray, d, before)
        assert grew("kv_failed_checksum") == 1 and grew("recomputed") == 0 and blocks_in_use(ray, d) == [0]
    finally:
        ray.get(d.configure.remote(policy="recompute"))


def _rss_kib(start: int) -> int:
    """Resident KiB of this process's mapping that begins at `start` (/proc/self/smaps)."""
    lines = open("/proc/self/smaps").read().splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{start:x}-"))
    return next(int(line.split()[1]) for line in lines[at + 1:] if line.startswith("Rss:"))


def test_prefault_makes_a_store_mapping_resident_without_changing_it(tmp_path):
    """`prefault_object_store`'s two halves on a plasma-named shared file: the mapping is found
    by name, and after `populate` all of it is resident in this process (no fault per page
    later), with its bytes as they were."""
    import mmap
    import os
    import uuid

    from cluster.kvtransfer.shared_store import object_store_mappings, populate

    path = f"/dev/shm/plasma-tandem-test-{uuid.uuid4().hex[:8]}"
    size = 8 << 20
    with open(path, "w+b") as f:
        f.truncate(size)
        m = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED)
    os.unlink(path)  # Ray's store file is unlinked too: "(deleted)" in /proc/self/maps
    try:
        m[size - 5:] = b"tail!"
        ours = [r for r in object_store_mappings() if r[1] - r[0] == size]
        assert len(ours) == 1
        assert _rss_kib(ours[0][0]) < size // 1024
        assert populate(ours) == size
        assert _rss_kib(ours[0][0]) == size // 1024
        assert m[size - 5:] == b"tail!" and m[:4] == b"\0\0\0\0"
    finally:
        m.close()


def test_rays_object_store_mapping_is_found(ray_local):
    """The mapping `prefault_object_store` populates is Ray's store as this process sees it."""
    import numpy as np

    from cluster.kvtransfer.shared_store import object_store_mappings

    ray_local.get(ray_local.put(np.zeros(1 << 20, dtype=np.uint8)))  # not inlined: in the store
    total = sum(end - start for start, end in object_store_mappings())
    assert total >= ray_local.available_resources()["object_store_memory"] * 0.5
