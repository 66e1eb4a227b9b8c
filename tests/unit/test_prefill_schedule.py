"""How a prefill replica's scheduler orders and batches prompts (`prefill_schedule: ttft`),
with the step cost pinned: what each step costs is then known, and so is every prompt's time
to its first token."""

import pytest

from builders import make_request, make_scheduler, run_step

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
