"""Draft lengths chosen by load (engine/spec/policy.py): deep at one stream, none when a step is
compute-bound, and less for a request whose drafts keep being rejected."""

from __future__ import annotations

from cluster.engine.spec.policy import MIN_RATE, DraftPolicy

# a CPU step of the default model: ~30 ms to stream the weights, ~2 ms per token computed
FIXED, PER_TOKEN = 0.030, 0.002


def test_one_stream_speculates_deeply_sixteen_compute_bound_streams_not_at_all():
    policy = DraftPolicy(max_tokens=5, adaptive=True)
    for _ in range(5):
        policy.observe("a", 5, 3)  # ~0.75 of positions accepted
    assert policy.choose(["a"], [5], 1, FIXED, PER_TOKEN) == [5]
    # 16 streams where each token costs as much as the weights: drafts lower the step's rate
    ids = [f"r{i}" for i in range(16)]
    for r in ids:
        policy.observe(r, 5, 3)
    assert policy.choose(ids, [5] * 16, 16, 0.027, 0.008) == [0] * 16


def test_poor_acceptance_shortens_drafts_and_good_acceptance_lengthens_them():
    policy = DraftPolicy(max_tokens=8, adaptive=True)
    for _ in range(10):
        policy.observe("poor", 4, 0)
        policy.observe("good", 4, 4)
    poor, good = policy.choose(["poor", "good"], [8, 8], 2, FIXED, 0.01)
    assert good == 8 and poor < 2


def test_limits_cap_the_choice_and_without_a_cost_fit_or_adaptive_each_gets_its_limit():
    policy = DraftPolicy(max_tokens=5, adaptive=True)
    assert policy.choose(["a", "b"], [3, 9], 2, None, None) == [3, 5]
    assert DraftPolicy(5, adaptive=False).choose(["a", "b"], [3, 0], 50, FIXED, 1.0) == [3, 0]


def test_a_new_request_starts_from_the_engine_wide_acceptance_and_probes_only_where_drafts_are_cheap():
    policy = DraftPolicy(max_tokens=5, adaptive=True)
    for i in range(50):
        policy.observe(f"old{i}", 5, 0)  # drafts never accepted so far on this engine
    assert policy.rate("new") == MIN_RATE  # floored: the engine's own estimate is ~0
    assert policy.choose(["new"], [5], 1, FIXED, PER_TOKEN) == [1]  # one stream: one draft costs ~nothing
    ids = [f"new{i}" for i in range(16)]
    assert policy.choose(ids, [5] * 16, 16, 0.027, 0.008) == [0] * 16  # under load: not worth a position
    for _ in range(5):
        policy.observe("new", 5, 5)  # its drafts turn out right: it speculates deeply again
    assert policy.choose(["new"], [5], 1, FIXED, PER_TOKEN) == [5]


def test_drafting_that_costs_a_whole_step_is_not_worth_it_even_always_accepted():
    """A draft model as large as the target (its pass costs what a step costs) saves nothing; a
    small one (a pass of ~1/60 of a step) is worth drafting deeply."""
    policy = DraftPolicy(max_tokens=5, adaptive=True)
    for _ in range(5):
        policy.observe("a", 5, 5)
    step = FIXED + PER_TOKEN
    assert policy.choose(["a"], [5], 1, FIXED, PER_TOKEN, drafting_s=step) == [0]
    assert policy.choose(["a"], [5], 1, FIXED, PER_TOKEN, drafting_s=step / 60) == [5]
