"""Prefix-cache-aware routing: what a replica reports of its prefix cache, and how the pools'
routers rank replicas with it (real Serve RequestRouter objects, replicas as plain stand-ins)."""

import asyncio
import itertools
from types import SimpleNamespace

import pytest
from builders import make_request
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
from ray.serve.request_router import PendingRequest

from cluster.engine.block_manager import BlockManager
from cluster.router import prefix_affinity
from cluster import cache_report as reports
from cluster.cache_report import cache_report
from cluster.router.prefix_affinity import CacheViews, QueueView
from cluster.router.request_routers import DecodeRouter, PrefillRouter
from cluster.sampling_params import SamplingParams

BS = 4


def cached_request(bm: BlockManager, prompt: list[int], salt: str | None = None, keep: bool = False):
    """Run `prompt` through the block manager as the engine does and leave its blocks cached."""
    req = make_request(prompt=prompt, cache_salt=salt)
    hits = bm.find_cached_prefix(req)
    assert bm.allocate(req, len(prompt) - BS * len(hits), hits)
    req.num_computed_tokens = len(prompt)
    bm.cache_full_blocks(req)
    if not keep:
        bm.free(req)
    return req


def held(stats: dict, prompt: list[int], salt: str | None = None) -> int:
    return CacheViews().cached_tokens("r", stats, prompt, salt, {})


def test_the_router_and_the_replica_count_the_tokens_the_engine_would_serve_from_cache():
    bm = BlockManager(num_blocks=32, block_size=BS)
    cached_request(bm, list(range(1, 14)))  # 3 full blocks cached
    cached_request(bm, list(range(1, 14)), salt="tenant-a")
    report = cache_report(bm)
    for prompt, salt in [(list(range(1, 30)), None), (list(range(1, 10)) + [99] * 9, None),
                         (list(range(1, 14)), None), (list(range(1, 13)), None), ([7] * 20, None),
                         (list(range(1, 30)), "tenant-a"), (list(range(1, 30)), "tenant-b")]:
        engine_hits = bm.find_cached_prefix(make_request(prompt=prompt, cache_salt=salt))
        assert held(report, prompt, salt) == BS * len(engine_hits), (prompt, salt)
        assert bm.cached_prefix_len(prompt, salt) == BS * len(engine_hits), (prompt, salt)  # a replica's own estimate
    assert held(report, list(range(1, 30))) == 12 and held(report, list(range(1, 30)), "tenant-b") == 0


def test_the_report_lists_blocks_in_use_then_the_last_to_be_evicted_up_to_the_limit(monkeypatch):
    bm = BlockManager(num_blocks=64, block_size=BS)
    old = cached_request(bm, [1] * 9)          # freed first: evicted first
    new = cached_request(bm, [2] * 9)          # freed last
    live = cached_request(bm, [3] * 9, keep=True)
    assert bm.cached_hashes(10) == live.block_hashes + new.block_hashes + old.block_hashes
    assert bm.cached_hashes(3) == live.block_hashes + new.block_hashes[:1]
    monkeypatch.setattr(reports, "DIGEST_LIMIT", 4)
    report = cache_report(bm)
    assert len(report["cached_blocks"]) == 4 * reports.HASH_BYTES
    assert held(report, [2] * 9) == 8 and held(report, [1] * 9) == 0
    assert cache_report(BlockManager(8, BS, enable_prefix_caching=False)) == {}


def test_a_replicas_queue_is_its_report_corrected_by_what_the_router_saw_since():
    now = [0.0]
    queues = QueueView(clock=lambda: now[0])
    queues.sent("r1", "A", 100, "call-1")
    queues.sent("r2", "A", 30, "call-2")
    queues.sent("r3", "B", 7, "call-3")
    assert queues.tokens("A", []) == 130 and queues.tokens("B", [["other-router", 50]]) == 57
    # once the report lists r1, the report's count for it is the one used, not both
    assert queues.tokens("A", [["r1", 120]]) == 120 + 30
    queues.ended("call-1")  # r1 answered: a stale report still listing it no longer counts
    assert queues.tokens("A", [["r1", 120]]) == 30
    queues.ended("call-3")  # answered before any report listed it
    assert queues.tokens("B", []) == 0
    now[0] = prefix_affinity.CORRECTION_TTL_S + 1  # past any report's lag: reports alone again
    assert queues.tokens("A", [["r1", 120]]) == 120 and queues.tokens("A", []) == 0


DEPLOYMENT = DeploymentID(name="Pool", app_name="tandem")
IDS = itertools.count()


def make_router(cls):
    router = cls(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA,
                 use_replica_queue_len_cache=True)
    router.initialize_state()
    return router


def replica(name: str, **stats):
    return SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=DEPLOYMENT), routing_stats=stats)


def choose(router, replicas, prompt: list[int], method: str = "prefill", salt: str | None = None) -> str:
    rid = f"req-{next(IDS)}"
    params = SamplingParams(cache_salt=salt)

    async def run():
        pending = PendingRequest(args=[rid, prompt, params, {}], kwargs={},
                                 metadata=RequestMetadata(request_id=rid, internal_request_id=rid, call_method=method))
        return await router.choose_replicas(replicas, pending)

    ranks = asyncio.run(run())
    return ranks[0][0].replica_id.unique_id


@pytest.fixture
def cache_of_a():
    bm = BlockManager(num_blocks=256, block_size=BS)
    cached_request(bm, list(range(1, 202)))  # 50 full blocks: 200 tokens
    return cache_report(bm)


def test_a_prompt_goes_where_its_prefix_is_cached_unless_the_queue_there_costs_more(cache_of_a):
    prompt = list(range(1, 211))  # 210 tokens: 200 of them cached on A
    for order in ("AB", "BA"):
        stats = {"A": cache_of_a, "B": {}}
        replicas = [replica(n, queued=[], **stats[n]) for n in order]
        assert choose(make_router(PrefillRouter), replicas, prompt) == "A"
    # 10 uncached tokens behind 150 queued on A beat 210 on an idle B; behind 250 they do not
    busy = lambda queued: [replica("A", queued=[["x", queued]], **cache_of_a), replica("B", queued=[])]
    assert choose(make_router(PrefillRouter), busy(150), prompt) == "A"
    assert choose(make_router(PrefillRouter), busy(250), prompt) == "B"
    # another tenant's salt: A's blocks are not its blocks
    assert choose(make_router(PrefillRouter), busy(150), prompt, salt="other") == "B"


def test_a_burst_inside_one_report_period_spreads_by_the_work_each_choice_adds(cache_of_a):
    replicas = [replica("A", queued=[], **cache_of_a), replica("B", queued=[])]
    cold = [[1000 + i] * 100 for i in range(4)]  # no prefix cached anywhere: they alternate
    router = make_router(PrefillRouter)
    assert sorted(choose(router, replicas, p) for p in cold) == ["A", "A", "B", "B"]
    # The same stats all along (no report since). Each prompt is 10 tokens uncached on A, 210
    # on B: A takes them until the 10s it has been sent add up to B's whole prompt.
    router = make_router(PrefillRouter)
    warm = [choose(router, replicas, list(range(1, 201)) + [5000 + i] * 10) for i in range(24)]
    assert warm == ["A"] * 21 + ["B", "A", "A"]
    # once Serve says a call ended, what it added is gone (here a call's id is its request id)
    sent = dict(router.queues._sent)
    for rid, (name, *_rest) in sent.items():
        if name == "B":
            router.on_request_completed(replicas[1].replica_id, rid)
    assert router.queues.tokens("B", []) == 0 and router.queues.tokens("A", []) == 23 * 10


def test_colocated_decode_replicas_break_load_ties_by_what_they_have_cached(cache_of_a):
    prompt = list(range(1, 211))
    idle = dict(free_blocks=1000, num_running=0, num_waiting=0)
    for order in ("AB", "BA"):
        stats = {"A": {**idle, **cache_of_a}, "B": idle}
        replicas = [replica(n, **stats[n]) for n in order]
        assert choose(make_router(DecodeRouter), replicas, prompt, method="generate") == "A"
    # load still comes first: a replica running more requests is not chosen for its cache
    replicas = [replica("A", **{**idle, "num_running": 3, **cache_of_a}), replica("B", **idle)]
    assert choose(make_router(DecodeRouter), replicas, prompt, method="generate") == "B"
