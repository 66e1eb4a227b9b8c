"""How a prefill replica's scheduler orders and batches prompts (`prefill_schedule: ttft`),
with the step cost pinned: what each step costs is then known, and so is every prompt's time
to its first token."""

import pytest

from builders import make_request, make_scheduler, run_step

from cluster.engine.arrivals import chunk_size
from cluster.engine.step_cost import StepCost

CPU = (0.036, 0.0012)  # (fixed, per token) seconds of a step: the default model, 1 thread, this host
GPU = (0.008, 0.00001)  # a step mostly fixed cost


def pinned(fixed: float, per_token: float) -> StepCost:
    cost = StepCost()
    cost.fixed_s, cost.per_token_s, cost.resolved = fixed, per_token, True
    return cost


def scheduler(cost: tuple[float, float] | None, schedule: str = "ttft", **config):
    sched = make_scheduler(num_blocks=1024, block_size=16, max_num_batched_tokens=512, **config,
                           prefill_schedule=schedule)
    if cost is not None:
        sched.step_cost = pinned(*cost)
    return sched


def prompt(sched, tokens: int, arrival: float, **params):
    req = make_request(prompt_len=tokens, max_tokens=1, **params)
    req.prefill_only, req.arrival_time = True, arrival
    sched.add(req)
    return req


def first_token_times(sched, cost: tuple[float, float]) -> dict[str, float]:
    """Run steps to the end, each as long as the pinned cost says: when each prompt is done."""
    clock, done = 0.0, {}
    while sched.has_work():
        plan, finished = run_step(sched)
        clock += cost[0] + cost[1] * plan.num_tokens
        done.update((r.request_id, clock) for r in finished)
    return done


def test_a_short_prompt_passes_a_long_one_that_came_just_before_it():
    sched = scheduler(CPU)
    long = prompt(sched, 400, arrival=0.0)
    short = prompt(sched, 10, arrival=0.1)  # 0.1 s later: well within the long one's ~0.5 s of work
    plan, _ = run_step(sched)
    assert plan.chunks[0].request is short
    done = first_token_times(sched, CPU)
    assert long.request_id in done  # served too, right after


def test_fcfs_keeps_arrival_order():
    sched = scheduler(CPU, schedule="fcfs")
    long = prompt(sched, 400, arrival=0.0)
    prompt(sched, 10, arrival=0.1)
    plan, _ = run_step(sched)
    assert plan.chunks[0].request is long


def test_a_long_prompt_waits_at_most_its_own_compute_time_behind_later_arrivals():
    sched = scheduler(CPU)
    long = prompt(sched, 400, arrival=0.0)  # its own work: 400 x 1.2 ms = 0.48 s
    shorts = [prompt(sched, 10, arrival=0.05 * i) for i in range(1, 40)]  # one every 50 ms, for ~2 s
    order = []
    while sched.has_work():
        plan, _ = run_step(sched)
        order += [c.request for c in plan.chunks if c.request not in order]
    ahead = order[:order.index(long)]
    own = CPU[1] * 400
    assert ahead, "short prompts that came within the long one's own time go first"
    assert all(r.arrival_time <= long.arrival_time + own for r in ahead)
    assert all(r in ahead for r in shorts if r.arrival_time + CPU[1] * 10 < own)


def test_priority_still_comes_first():
    sched = scheduler(CPU, scheduling_policy="priority")
    low = prompt(sched, 10, arrival=0.0, priority=1)
    urgent = prompt(sched, 400, arrival=0.1, priority=0)
    plan, _ = run_step(sched)
    assert [c.request for c in plan.chunks][:2] == [urgent, low]  # short and earlier, still second


@pytest.mark.parametrize("n", [16, 64])
def test_a_burst_of_short_prompts_goes_in_small_steps_on_a_cpu(n):
    """The step sizes the rule picks give a lower mean time to first token than one step for all
    or one prompt per step, and each step holds at most 1 + fixed / (per_token x tokens) prompts."""
    sched = scheduler(CPU)
    for i in range(n):
        prompt(sched, 12, arrival=0.0)
    sizes = []
    clock, done = 0.0, []
    while sched.has_work():
        plan, finished = run_step(sched)
        sizes.append(len(plan.chunks))
        clock += CPU[0] + CPU[1] * plan.num_tokens
        done += [clock] * len(finished)
    assert max(sizes) <= 1 + CPU[0] / (CPU[1] * 12) and len(sizes) > 1
    mean = sum(done) / n
    all_at_once = CPU[0] * -(-n * 12 // 512) + CPU[1] * 12 * n  # every prompt waits for the last step
    one_by_one = sum((k + 1) * (CPU[0] + CPU[1] * 12) for k in range(n)) / n
    assert mean < all_at_once and mean < one_by_one


def test_on_a_gpu_the_budget_takes_the_whole_burst():
    sched = scheduler(GPU)
    reqs = [prompt(sched, 12, arrival=0.0) for _ in range(16)]
    plan, _ = run_step(sched)
    assert [c.request for c in plan.chunks] == reqs


def test_until_the_cost_is_known_the_budget_takes_the_whole_burst():
    sched = scheduler(None)
    reqs = [prompt(sched, 12, arrival=0.0) for _ in range(16)]
    plan, _ = run_step(sched)
    assert [c.request for c in plan.chunks] == reqs


def test_decode_requests_are_not_reordered_or_held_back():
    sched = scheduler(CPU)
    reqs = [make_request(prompt_len=12, max_tokens=4) for _ in range(8)]
    for r in reqs:
        sched.add(r)
    plan, _ = run_step(sched)
    assert [c.request for c in plan.chunks] == reqs


def test_a_fit_that_cannot_resolve_a_tokens_cost_batches_as_the_budget_allows():
    """A tiny model or a GPU: a step's tokens cost less than its noise, the fit falls back to no
    fixed part and the average cost per token (step_cost.py). Read as costs, that would batch
    nothing; the scheduler takes it as not known and fills the step's budget."""
    sched = scheduler(None)
    sched.step_cost.observe(1, 0.0010)
    sched.step_cost.observe(64, 0.0009)  # more tokens, a faster step: noise
    assert sched.step_cost.fixed_s == 0.0 and not sched.step_cost.resolved
    prompts = [prompt(sched, n, arrival=0.01 * i) for i, n in enumerate((5, 37, 20))]
    plan, finished = run_step(sched)
    assert [c.request for c in plan.chunks] == prompts and set(finished) == set(prompts)


def test_a_short_prompt_that_arrives_during_a_long_ones_chunks_passes_it_between_steps():
    """The long prompt's first chunk is running when the short one comes: the short one waits
    for that chunk only, the long one goes on in the step after, and its blocks stay its own."""
    sched = scheduler(CPU, long_prefill_token_threshold=128)
    long = prompt(sched, 1024, arrival=0.0)
    plan, _ = run_step(sched)
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(long, 128)]
    short = prompt(sched, 20, arrival=0.2)
    plan, finished = run_step(sched)
    assert [c.request for c in plan.chunks] == [short] and finished == [short]
    assert long.num_computed_tokens == 128 and len(long.block_ids) == 128 // 16
    plan, _ = run_step(sched)
    assert [(c.request, c.start, c.num_tokens) for c in plan.chunks] == [(long, 128, 128)]


def test_fcfs_runs_a_prompt_part_way_through_its_chunks_to_its_end():
    sched = scheduler(CPU, schedule="fcfs", long_prefill_token_threshold=128)
    long = prompt(sched, 1024, arrival=0.0)
    run_step(sched)
    prompt(sched, 20, arrival=0.2)
    plan, _ = run_step(sched)
    assert plan.chunks[0].request is long and plan.chunks[0].num_tokens == 128


def test_a_long_prompt_part_way_through_is_passed_by_later_arrivals_for_at_most_its_own_time_left():
    """A stream of short prompts, one every 50 ms, each its own step: the long one, part way
    through, is passed only by those that come before its arrival + the compute time it has left."""
    sched = scheduler(CPU, long_prefill_token_threshold=128)
    long = prompt(sched, 1024, arrival=0.0)
    run_step(sched)
    left = CPU[1] * (1024 - 128)
    shorts = [prompt(sched, 10, arrival=0.05 * i) for i in range(1, 40)]
    order = []  # the short prompts done in steps before the long one's next chunk
    while True:
        plan, _ = run_step(sched)
        if any(c.request is long for c in plan.chunks):
            break
        order += [c.request for c in plan.chunks]
    assert order, "the short prompts that came before its time left went first"
    assert all(r.arrival_time + CPU[1] * 10 <= left for r in order)
    assert all(r in order for r in shorts if r.arrival_time + CPU[1] * 10 < left)
    assert not sched.waiting or min(r.arrival_time for r in sched.waiting) + CPU[1] * 10 >= left


def test_a_prompt_passed_over_goes_on_when_the_one_that_passes_it_cannot_start():
    """No blocks for the short prompt: the long one part way through is not left idle."""
    sched = make_scheduler(num_blocks=10, block_size=16, max_num_batched_tokens=512,
                           long_prefill_token_threshold=64)
    sched.step_cost = pinned(*CPU)
    long = prompt(sched, 150, arrival=0.0)
    run_step(sched)
    run_step(sched)  # 128 of its tokens, 8 of the 10 blocks
    prompt(sched, 60, arrival=0.01)  # needs 4 blocks: it must wait for the long one to end
    plan, _ = run_step(sched)
    assert [c.request for c in plan.chunks] == [long]


@pytest.mark.parametrize("tokens,chunks", [(300, [128, 128, 44]), (260, [128, 132]), (100, [100])])
def test_the_chunk_cap_spreads_a_long_prompt_over_steps(tokens, chunks):
    """At most 128 tokens of one prompt a step, a last sliver (<= 128 // 16) folded into the step
    before, a prompt under the cap in one step."""
    sched = scheduler(None, long_prefill_token_threshold=128)
    req = prompt(sched, tokens, arrival=0.0)
    seen = []
    while sched.has_work():
        plan, _ = run_step(sched)
        seen += [c.num_tokens for c in plan.chunks if c.request is req]
    assert seen == chunks


@pytest.mark.parametrize("bad", [-1, 1.5, True, "128"])
def test_long_prefill_token_threshold_must_be_an_integer_at_least_zero(bad):
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an integer >= 0"):
        scheduler(None, long_prefill_token_threshold=bad)


def test_without_chunked_prefill_the_cap_does_not_apply():
    sched = scheduler(None, long_prefill_token_threshold=128, enable_chunked_prefill=False)
    req = prompt(sched, 300, arrival=0.0)
    plan, _ = run_step(sched)
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(req, 300)]


@pytest.mark.parametrize("now,passed", [
    (0.3, True),    # 896 tokens left in 7 steps: 1.33 s; done at 1.63 s, 1.71 s with the pass (84 ms)
    (0.63, False),  # done at 1.96 s without the pass, 2.04 s with it: not passed
    (0.9, True),    # done at 2.23 s either way: late anyway, passed
    (1.5, False),   # it has waited its own time left (1.08 s): the order puts it first
])
def test_with_a_ttft_slo_a_prompt_is_not_passed_when_the_pass_alone_makes_it_late(now, passed):
    fast = (0.036, 0.0012)
    sched = scheduler(fast, long_prefill_token_threshold=128, ttft_slo_ms=2000)
    long = prompt(sched, 1024, arrival=0.0)
    run_step(sched)
    sched.clock = lambda: now
    short = prompt(sched, 40, arrival=now)
    plan, _ = run_step(sched)
    assert [c.request for c in plan.chunks][0] is (short if passed else long)


def test_the_prefill_pool_takes_the_apps_ttft_slo():
    from cluster.app_config import AppConfig
    from cluster.config import EngineConfig

    app = AppConfig(ttft_slo_ms=2000, itl_slo_ms=150)
    assert app.prefill_engine.scheduler.ttft_slo_ms == 2000
    assert app.engine.scheduler.ttft_slo_ms == 0  # the decode pool places by it instead
    assert AppConfig().prefill_engine == EngineConfig() == AppConfig().engine


HOST = (0.068, 0.0022)  # the default model in float32 on a core of the AVX-512 Xeon (2026-11-29)


def chunks_of(sched, req) -> list[int]:
    seen = []
    while sched.has_work():
        plan, _ = run_step(sched)
        seen += [c.num_tokens for c in plan.chunks if c.request is req]
    return seen


def arrivals(sched, rate: float, until: float, tokens: int = 10) -> None:
    """Prompts at `rate` a second up to `until`, served before the test's own prompt."""
    sched.clock = lambda: until
    for i in range(int(rate * until)):
        prompt(sched, tokens, arrival=i / rate)
    while sched.has_work():
        run_step(sched)


@pytest.mark.parametrize("rate,tokens,chunks", [
    (0.1, 10, [512, 512]),            # a prompt every 10 s: the steps saved outweigh the waits added
    (0.5, 10, [256, 256, 256, 256]),  # between
    (2.0, 10, [128] * 8),             # a steady stream: the cap
    (0.5, 400, [128] * 8),            # as many prompts, but each ~1 s of work: a queue forms behind
])
def test_chunks_by_arrivals_follow_the_arrival_rate_and_load(rate, tokens, chunks):
    """1,024 tokens at a fit of 68 ms + 2.2 ms a token: a chunk of 512 takes 1.19 s and saves 3
    steps (0.2 s) against chunks of 128, and makes each prompt arriving during it wait 0.42 s
    longer on average (more when the replica is busy: x 1 / (1 - load)); worth it below ~0.33
    short prompts a second, and 256 up to ~0.77. Prompts of 400 tokens at 0.5 a second keep the
    replica ~46% busy: even 256 no longer pays."""
    sched = scheduler(HOST, long_prefill_token_threshold=128, chunk_by_arrivals=True)
    arrivals(sched, rate, until=60.0, tokens=tokens)
    long = prompt(sched, 1024, arrival=60.0)
    assert chunks_of(sched, long) == chunks


def test_chunks_by_arrivals_take_the_budget_alone_on_a_quiet_replica_and_the_cap_when_busy():
    sched = scheduler(HOST, long_prefill_token_threshold=128, chunk_by_arrivals=True)
    arrivals(sched, 2.0, until=30.0)
    rate, load = sched.arrivals.seen(30.0, *HOST)
    assert rate == pytest.approx(60 / 32) and load == pytest.approx(60 * (0.068 + 0.022) / 32)
    sched.clock = lambda: 95.0  # a quiet minute and more since: the window holds none of them
    assert sched.arrivals.seen(95.0, *HOST) == (0.0, 0.0)
    long = prompt(sched, 1024, arrival=95.0)
    assert chunks_of(sched, long) == [512, 512]


def test_a_first_prompt_on_a_new_replica_keeps_the_cap():
    """No history: one arrival reads as 0.5 a second (ARRIVAL_PRIOR_S), over the break-even."""
    sched = scheduler(HOST, long_prefill_token_threshold=128, chunk_by_arrivals=True)
    sched.clock = lambda: 0.0
    long = prompt(sched, 1024, arrival=0.0)
    assert chunks_of(sched, long)[0] < 512


@pytest.mark.parametrize("config", [
    {"chunk_by_arrivals": False},                                   # off: the cap always
    {"chunk_by_arrivals": True, "prefill_schedule": "fcfs"},        # only under ttft
])
def test_chunks_by_arrivals_only_where_set_and_under_ttft(config):
    schedule = config.pop("prefill_schedule", "ttft")
    sched = scheduler(HOST, schedule, long_prefill_token_threshold=128, **config)
    sched.clock = lambda: 600.0
    long = prompt(sched, 1024, arrival=600.0)
    assert chunks_of(sched, long) == [128] * 8


def test_chunks_by_arrivals_leave_a_decoding_request_alone():
    """A request that is not prefill-only (colocated, or a decode replica's local prefill) keeps
    the cap: its streams' steps are what `max_step_ms` guards."""
    sched = scheduler(HOST, long_prefill_token_threshold=128, chunk_by_arrivals=True)
    sched.clock = lambda: 600.0
    req = make_request(prompt_len=1024, max_tokens=1)
    req.arrival_time = 600.0
    sched.add(req)
    assert chunks_of(sched, req) == [128] * 8


def test_a_short_prompt_arriving_during_a_big_chunk_still_passes_the_long_one_after_it():
    """The short one waits for the chunk in progress, as under the cap, and not for the rest."""
    sched = scheduler(HOST, long_prefill_token_threshold=128, chunk_by_arrivals=True)
    arrivals(sched, 0.1, until=60.0)
    long = prompt(sched, 1024, arrival=60.0)
    plan, _ = run_step(sched)
    assert [(c.request, c.num_tokens) for c in plan.chunks] == [(long, 512)]
    short = prompt(sched, 20, arrival=60.5)
    sched.clock = lambda: 60.5
    plan, finished = run_step(sched)
    assert finished == [short] and long.num_computed_tokens == 512


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_chunk_by_arrivals_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="chunk_by_arrivals must be true or false"):
        scheduler(None, chunk_by_arrivals=bad)


def test_chunks_by_arrivals_keep_a_minute_of_arrivals_not_every_one():
    """Short prompts only, never one long enough to chunk: what is kept stays a window's worth."""
    sched = scheduler(HOST, long_prefill_token_threshold=128, chunk_by_arrivals=True)
    for i in range(3000):  # 10 a second for five minutes
        sched.clock = lambda i=i: i / 10
        prompt(sched, 10, arrival=i / 10)
        run_step(sched)
    assert 600 <= len(sched.arrivals.arrivals) <= 601
    assert sched.arrivals.tokens == 10 * len(sched.arrivals.arrivals)


@pytest.mark.parametrize("rest,cap,budget,rate,load,size", [
    (1024, 128, 512, 0.0, 0.0, 512),   # nothing arrives: the biggest the budget allows
    (300, 128, 512, 0.0, 0.0, 512),    # ...which takes all 300 in one step
    (1024, 100, 512, 0.0, 0.0, 512),   # multiples of the cap, the budget the last
    (1024, 128, 512, 0.1, 1.0, 128),   # a replica loaded to its full: the cap
    (100, 128, 512, 0.0, 0.0, 128),    # nothing to chunk
    (1024, 512, 512, 0.0, 0.0, 512),   # the cap is the budget
])
def test_chunk_size(rest, cap, budget, rate, load, size):
    assert chunk_size(rest, cap, budget, *HOST, rate, load) == size
