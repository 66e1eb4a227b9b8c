import pytest

from builders import make_request, make_scheduler, run_step

from cluster.engine.request import RequestStatus
from cluster.engine.scheduler import steps_for


def test_decodes_and_new_prefills_share_a_step_within_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=16)
    a = make_request(prompt_len=6)
    sched.add(a)
    run_step(sched)
    b, c = make_request(prompt_len=10), make_request(prompt_len=10)
    sched.add(b)
    sched.add(c)
    plan, _ = run_step(sched)
    assert [(ch.request, ch.num_tokens) for ch in plan.chunks] == [(a, 1), (b, 10), (c, 5)]
    assert plan.num_tokens == 16
    assert not plan.chunks[2].samples  # c's prompt is only partly computed
    assert c.num_computed_tokens == 5 and c.num_output_tokens == 0


def test_chunked_prefill_continues_until_the_prompt_is_done():
    sched = make_scheduler(max_num_batched_tokens=4)
    req = make_request(prompt_len=10, max_tokens=2)
    sched.add(req)
    sizes = []
    while not req.is_finished:
        plan, _ = run_step(sched)
        sizes.append(plan.chunks[0].num_tokens)
    assert sizes == [4, 4, 2, 1]
    assert req.output_token_ids == [5, 5] and req.status == RequestStatus.FINISHED_LENGTH


def test_a_prompt_finishes_in_one_step_rather_than_leave_a_sliver_for_the_next():
    sched = make_scheduler(max_num_batched_tokens=32)  # a sliver: at most 32 // 16 = 2 tokens
    near, over = make_request(prompt_len=66, max_tokens=1), make_request(prompt_len=67, max_tokens=1)
    steps = {}
    for req in (near, over):
        sched.add(req)
        sizes = []
        while not req.is_finished:
            plan, _ = run_step(sched)
            sizes.append(plan.chunks[0].num_tokens)
        steps[len(req.prompt_token_ids)] = sizes
    assert steps == {66: [32, 34], 67: [32, 32, 3]}
    assert [steps_for(n, 32) for n in (1, 32, 34, 35, 66, 67)] == [1, 1, 1, 2, 2, 3]  # placement's count
    short = make_request(prompt_len=33, max_tokens=1)  # admitted whole: 33 in a step of 32
    sched.add(short)
    plan, _ = run_step(sched)
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(short, 33)]
    assert short.is_finished and short.num_output_tokens == 1  # its first token, one step


def test_max_num_seqs_limits_the_running_batch():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(prompt_len=3) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    plan, _ = run_step(sched)
    assert [c.request for c in plan.chunks] == reqs[:2]
    assert reqs[2].status == RequestStatus.WAITING


def test_preemption_recomputes_the_newest_request_when_blocks_run_out():
    sched = make_scheduler(num_blocks=4, block_size=4)
    old, new = make_request(prompt_len=8, max_tokens=6), make_request(prompt_len=7, max_tokens=6)
    sched.add(old)
    sched.add(new)
    run_step(sched)  # both prefilled: 2 blocks each, cache full
    plan, _ = run_step(sched)  # old needs a 3rd block → new is preempted
    assert plan.preempted == [new.request_id]
    assert new.status == RequestStatus.PREEMPTED and new.block_ids == []
    assert new.num_computed_tokens == 0 and new.num_output_tokens == 1
    while sched.has_work():
        run_step(sched)
    assert old.output_token_ids == [5] * 6 and new.output_token_ids == [5] * 6
    assert sched.blocks.num_free_blocks == 4


def test_eos_stop_token_and_min_tokens():
    sched = make_scheduler()
    eos = make_request(prompt_len=4, max_tokens=10)
    stop = make_request(prompt_len=4, max_tokens=10, stop_token_ids=[7])
    ignore = make_request(prompt_len=4, max_tokens=3, ignore_eos=True)
    for r in (eos, stop, ignore):
        sched.add(r)
    run_step(sched, token=7)
    assert stop.status == RequestStatus.FINISHED_STOPPED and stop.stop_reason == 7
    assert eos.status == RequestStatus.RUNNING and ignore.status == RequestStatus.RUNNING
    run_step(sched, token=0)  # 0 is EOS
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert ignore.status == RequestStatus.RUNNING


def test_abort_frees_blocks_in_every_state():
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    running, waiting = make_request(prompt_len=5), make_request(prompt_len=5)
    sched.add(running)
    sched.add(waiting)
    run_step(sched)
    sched.abort(running.request_id)
    sched.abort(waiting.request_id)
    assert running.status == waiting.status == RequestStatus.FINISHED_ABORTED
    assert sched.blocks.num_free_blocks == 8 and not sched.has_work()


def test_prefill_only_holds_blocks_until_released():
    sched = make_scheduler(num_blocks=8)
    req = make_request(prompt_len=9)
    req.prefill_only = True
    sched.add(req)
    _, finished = run_step(sched)
    assert finished == [req] and req.status == RequestStatus.FINISHED_PREFILLED
    assert sched.blocks.num_free_blocks == 5
    sched.release(req.request_id)
    assert sched.blocks.num_free_blocks == 8


def test_remote_admission_then_decode_or_recompute():
    """`bad` has the same prompt: its recompute reuses the blocks `ok` received."""
    sched = make_scheduler(num_blocks=8)
    prompt = list(range(1, 10))
    ok, bad = make_request(prompt=prompt), make_request(prompt=prompt)
    for r in (ok, bad):
        r.append_token(5)
        assert len(sched.add_remote(r)) == 3
    sched.finish_remote(ok.request_id, ok=True)
    sched.finish_remote(bad.request_id, ok=False, recompute=True)
    plan, _ = run_step(sched)
    assert [(c.request, c.start, c.num_tokens) for c in plan.chunks] == [(ok, 9, 1), (bad, 8, 2)]


def test_remote_admission_shares_the_cached_prefix_and_returns_only_the_blocks_to_fill():
    sched = make_scheduler(num_blocks=8)
    first = make_request(prompt=list(range(1, 10)))
    sched.add_remote(first)
    sched.finish_remote(first.request_id, ok=True)  # its full blocks [1-4], [5-8] are cached now
    following = make_request(prompt=list(range(1, 9)) + [42, 43, 44])  # shares 2 blocks, 11 tokens
    fill = sched.add_remote(following)
    assert following.block_ids[:2] == first.block_ids[:2] and fill == following.block_ids[2:]
    assert following.num_computed_tokens == 8 and sched.blocks.num_free_blocks == 8 - 3 - 1
    sched.finish_remote(following.request_id, ok=True)
    for r in (first, following):
        sched.abort(r.request_id)
    assert sched.blocks.num_free_blocks == 8


def test_remote_admission_refused_when_blocks_do_not_fit():
    sched = make_scheduler(num_blocks=2)
    req = make_request(prompt_len=9)
    assert sched.add_remote(req) is None
    assert sched.blocks.num_free_blocks == 2


def admission_order(policy: str, priorities: list[int]) -> list[int]:
    """The order in which requests added together (one running at a time) get their first step."""
    sched = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    reqs = [make_request(prompt_len=4, max_tokens=2, priority=p) for p in priorities]
    for r in reqs:
        sched.add(r)
    order: list[int] = []
    while sched.has_work():
        plan, _ = run_step(sched)
        order += [reqs.index(c.request) for c in plan.chunks if reqs.index(c.request) not in order]
    return order


def test_priority_policy_admits_lower_priority_values_first_then_by_arrival():
    assert admission_order("priority", [0, 5, -1, 5, 0]) == [2, 0, 4, 1, 3]
    assert admission_order("fcfs", [0, 0, 0]) == [0, 1, 2]


def test_priority_policy_preempts_the_lowest_ranked_request_not_the_newest():
    sched = make_scheduler(num_blocks=4, block_size=4, scheduling_policy="priority")
    low, high = make_request(prompt_len=7, max_tokens=6, priority=1), make_request(prompt_len=7, max_tokens=6)
    sched.add(low)
    run_step(sched)  # low prefilled alone, then high arrives: fcfs would preempt high, the newer one
    sched.add(high)
    run_step(sched)  # high prefilled, low decodes: 2 blocks each, cache full
    plan, _ = run_step(sched)  # low needs a 3rd block → low itself is preempted, high goes on
    assert plan.preempted == [low.request_id] and low.status == RequestStatus.PREEMPTED
    assert [c.request for c in plan.chunks] == [high]
    while sched.has_work():
        run_step(sched)
    assert high.output_token_ids == [5] * 6 and low.output_token_ids == [5] * 6
    assert sched.blocks.num_free_blocks == 4


def test_an_unknown_policy_or_a_bad_priority_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        make_scheduler(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="priority"):
        make_request(priority=1.5)


def test_a_request_waiting_for_blocks_counts_one_prefix_lookup_when_admitted():
    sched = make_scheduler(num_blocks=4, block_size=4)
    first, waits = make_request(prompt_len=12, max_tokens=4), make_request(prompt_len=8, max_tokens=2)
    sched.add(first)
    sched.add(waits)
    steps = 0
    while waits.status == RequestStatus.WAITING:  # 3 of 4 blocks held, then 4: no room for 2 more
        run_step(sched)
        steps += 1
    assert steps > 2
    while sched.has_work():
        run_step(sched)
    assert sched.blocks.prefix_queries == 12 + 8  # each prompt once (the metric vllm:prefix_cache_queries)


def test_a_prompt_another_request_is_computing_waits_for_its_blocks_then_takes_them_from_the_cache():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
    prompt = list(range(1, 19))  # 4 full blocks + 2 tokens
    first, twin, other = make_request(prompt=prompt), make_request(prompt=prompt), make_request(prompt_len=3)
    tail = make_request(prompt=prompt[:9] + [99] * 6)  # shares 2 full blocks, then differs
    for r in (first, twin, other, tail):
        sched.add(r)
    plan, _ = run_step(sched)  # first's prompt in chunks of 8; the others that share it wait
    assert [c.request for c in plan.chunks] == [first] and twin.status == RequestStatus.WAITING
    plan, _ = run_step(sched)
    assert [c.request for c in plan.chunks] == [first]  # the budget: the 3-token prompt is next in line
    plan, _ = run_step(sched)  # first's last 2 tokens; its 4 full blocks were cached last step
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(first, 2), (twin, 2), (other, 3), (tail, 1)]
    assert twin.num_cached_tokens == 16 and twin.block_ids[:4] == first.block_ids[:4]
    assert tail.num_cached_tokens == 8 and tail.block_ids[:2] == first.block_ids[:2]
    while sched.has_work():
        run_step(sched)
    assert sched.blocks.prefix_hits == 16 + 8 and sched.blocks.num_free_blocks == 64


def test_without_prefix_caching_or_for_a_scored_prompt_nothing_waits():
    for sched, params in ((make_scheduler(block_size=4, prefix_caching=False), {}),
                          (make_scheduler(block_size=4), {"prompt_logprobs": 1})):
        prompt = list(range(1, 19))
        a, b = make_request(prompt=prompt, **params), make_request(prompt=prompt, **params)
        sched.add(a)
        sched.add(b)
        plan, _ = run_step(sched)
        assert [c.request for c in plan.chunks] == [a, b]


def _pinned_cost(sched, fixed: float, per_token: float) -> None:
    cost = sched.step_cost
    cost.fixed_s, cost.per_token_s, cost.resolved = fixed, per_token, True


def test_max_step_ms_cuts_a_long_prompt_into_steps_that_keep_the_streams_itl():
    # 30 ms + 1 ms per token, capped at 150 ms: beside 8 decoding streams, 112 prompt tokens a step
    sched = make_scheduler(num_blocks=1024, block_size=16, max_num_batched_tokens=512, max_step_ms=150)
    _pinned_cost(sched, 0.030, 0.001)
    streams = [make_request(prompt_len=10, max_tokens=100) for _ in range(8)]
    for r in streams:
        sched.add(r)
    run_step(sched)  # their prompts: no stream decodes yet, so the step is not cut
    long = make_request(prompt_len=600, max_tokens=4)
    sched.add(long)
    chunks = []
    while long.num_computed_tokens < long.num_prompt_tokens:
        plan, _ = run_step(sched)
        assert {ch.request for ch in plan.chunks if ch.num_tokens == 1} == set(streams)  # every stream, every step
        assert 0.030 + 0.001 * plan.num_tokens <= 0.150 + 1e-9
        chunks.append(next(ch.num_tokens for ch in plan.chunks if ch.request is long))
    assert chunks == [112, 112, 112, 112, 112, 40]


def test_max_step_ms_leaves_a_step_uncut_with_no_stream_decoding_and_always_moves_a_prompt_on():
    sched = make_scheduler(num_blocks=1024, block_size=16, max_num_batched_tokens=512, max_step_ms=150)
    _pinned_cost(sched, 0.030, 0.001)
    alone = make_request(prompt_len=600, max_tokens=1)
    sched.add(alone)
    plan, _ = run_step(sched)
    assert plan.num_tokens == 512  # nobody waits on this step's length
    # streams whose step alone costs more than the cap: the prompt still gets MIN_PROMPT_CHUNK
    sched = make_scheduler(num_blocks=1024, block_size=16, max_num_batched_tokens=512, max_step_ms=150)
    _pinned_cost(sched, 0.100, 0.001)
    streams = [make_request(prompt_len=1, max_tokens=50) for _ in range(60)]
    for r in streams:
        sched.add(r)
    run_step(sched)
    late = make_request(prompt_len=100)
    sched.add(late)
    plan, _ = run_step(sched)
    assert [ch.num_tokens for ch in plan.chunks if ch.request is late] == [16]


def test_max_step_ms_must_be_a_number_at_least_zero():
    with pytest.raises(ValueError, match="max_step_ms"):
        make_scheduler(max_step_ms=-1)
