import random

import pytest
from builders import make_request, make_scheduler, make_speculator, run_spec_step, run_step

from cluster.engine.block_manager import BlockManager
from cluster.engine.request import RequestStatus


def test_allocation_covers_tokens_and_free_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    req = make_request(prompt_len=10)
    assert bm.allocate(req, 10)
    assert len(req.block_ids) == 3 and bm.num_free_blocks == 5
    req.num_computed_tokens = 10
    assert bm.allocate(req, 2)  # 12 tokens still fit in 3 blocks
    assert len(req.block_ids) == 3
    assert bm.allocate(req, 3)  # 13 tokens need a 4th
    assert len(req.block_ids) == 4
    bm.free(req)
    assert bm.num_free_blocks == 8 and req.block_ids == []


def test_allocation_refused_without_partial_change():
    bm = BlockManager(num_blocks=2, block_size=4)
    req = make_request(prompt_len=12)
    assert not bm.allocate(req, 12)
    assert req.block_ids == [] and bm.num_free_blocks == 2


def test_shared_prefix_reuses_blocks_and_counts_hits():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks + 1
    a = make_request(prompt=prompt)
    assert bm.allocate(a, 13, bm.find_cached_prefix(a))
    a.num_computed_tokens = 13
    bm.cache_full_blocks(a)
    b = make_request(prompt=prompt[:12] + [99])
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_ids[:3]
    assert bm.allocate(b, 1, hits)
    assert b.block_ids[:3] == a.block_ids[:3] and b.block_ids[3] != a.block_ids[3]
    assert bm.prefix_hits == 12
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_cache_salt_keeps_tenants_out_of_each_others_prefix_cache():
    bm = BlockManager(num_blocks=32, block_size=4)
    prompt = list(range(1, 14))

    def run(salt):  # a request of `prompt` with that salt, left cached: its prefix hits
        req = make_request(prompt=prompt, cache_salt=salt)
        hits = bm.find_cached_prefix(req)
        assert bm.allocate(req, 13 - 4 * len(hits), hits)
        req.num_computed_tokens = 13
        bm.cache_full_blocks(req)
        bm.free(req)
        return len(hits)

    assert run("tenant-a") == 0
    assert run("tenant-a") == 3  # the same salt shares the prefix
    assert run("tenant-b") == 0 and run(None) == 0  # another salt, or none, does not
    assert run(None) == 3 and run("tenant-b") == 3
    assert bm.num_free_blocks == 32


def test_fully_cached_prompt_still_computes_its_last_token_in_a_private_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 9))  # exactly 2 blocks
    a = make_request(prompt=prompt)
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    b = make_request(prompt=prompt)
    assert bm.find_cached_prefix(b) == a.block_ids[:1]


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_request(prompt=list(range(1, 10)))
    bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.free(a)
    b = make_request(prompt=list(range(1, 10)))
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2  # revived from the free queue
    assert bm.allocate(b, 1, hits) and bm.num_free_blocks == 1
    bm.free(b)
    c = make_request(prompt=[50] * 16)  # needs all 4 blocks: evicts the cached ones
    assert bm.allocate(c, 16)
    assert bm.cached == {}


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "drafts rejected at random"])
def test_random_workloads_leave_no_block_in_use(speculate):
    rng = random.Random(0)
    for trial in range(20):
        num_blocks, block_size = rng.randint(12, 40), rng.choice([2, 4, 8])
        capacity = num_blocks * block_size  # the engine caps max_model_len to this
        sched = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                               max_num_seqs=rng.randint(1, 8), max_num_batched_tokens=rng.randint(8, 64))
        shared = [rng.randrange(1, 50) for _ in range(24)]
        spec = make_speculator(sched, k=rng.randint(1, 6)) if speculate else None
        live = []
        for step in range(300):
            if rng.random() < 0.3 and len(live) < 30:
                prefix = shared[: rng.randint(0, 24)]
                prompt = prefix + [rng.randrange(1, 50) for _ in range(rng.randint(1, 16))]
                req = make_request(prompt=prompt[: capacity - 1], max_tokens=rng.randint(1, 20),
                                   max_model_len=capacity)
                sched.add(req)
                live.append(req)
            if live and rng.random() < 0.05:
                sched.abort(rng.choice(live).request_id)
            one_step(sched, spec, rng)
        while sched.has_work():
            one_step(sched, spec, rng)
        assert all(r.is_finished for r in live)
        assert sched.blocks.num_free_blocks == sched.blocks.num_blocks, f"trial {trial} leaked"
        assert all(c == 0 for c in sched.blocks.ref_counts)
        assert any(r.status == RequestStatus.FINISHED_LENGTH for r in live)
        if speculate:
            assert spec.counters["spec_num_accepted_tokens"] > 0
            assert spec.counters["spec_num_draft_tokens"] > spec.counters["spec_num_accepted_tokens"]


def one_step(sched, spec, rng):
    if spec is None:
        return run_step(sched, token=rng.randrange(1, 50))
    return run_spec_step(sched, spec, rng, token=rng.randrange(1, 50))
