"""The step-cost fit (engine/step_cost.py): what one more token adds to a step, from step times."""

from __future__ import annotations

import random

import pytest

from cluster.engine.step_cost import MIN_TAIL_STEPS, TAIL_FLOOR_S, StepCost


def test_the_slope_of_noisy_steps_is_found_and_the_fixed_part_left_out():
    rng = random.Random(0)
    fit = StepCost()
    for _ in range(300):  # 20 ms a step + 1.5 ms a token, ±10% noise, batches of 1-16 and chunks of 64
        n = rng.choice([1, 2, 4, 8, 16, 64])
        fit.observe(n, (0.020 + 0.0015 * n) * rng.uniform(0.9, 1.1))
    assert fit.per_token_s == pytest.approx(0.0015, rel=0.1)
    assert fit.fixed_s == pytest.approx(0.020, rel=0.1)  # what speculation's draft lengths weigh against
    assert fit.extra_seconds(40) == pytest.approx(0.060, rel=0.1)  # not 40 x the average step per token


def test_steps_of_one_size_say_nothing_about_a_token_until_another_size_comes():
    fit = StepCost()
    assert fit.extra_seconds(10) is None
    for _ in range(50):
        fit.observe(1, 0.022)  # a single stream: every step is one token
    assert fit.per_token_s is None and fit.extra_seconds(10) is None
    fit.observe(65, 0.022 + 64 * 0.001)
    assert fit.per_token_s == pytest.approx(0.001, rel=1e-6)


def test_the_fit_follows_a_host_that_slows_down():
    fit = StepCost()
    for i in range(200):
        n = 1 + i % 16
        fit.observe(n, 0.02 + 0.001 * n)
    assert fit.per_token_s == pytest.approx(0.001, rel=1e-6)
    for i in range(600):  # ~1/(1-0.99) steps of memory: the old host's steps fade out
        n = 1 + i % 16
        fit.observe(n, 0.04 + 0.002 * n)
    assert fit.per_token_s == pytest.approx(0.002, rel=0.02)


def test_a_slope_tilted_below_zero_by_noise_falls_back_to_the_average_cost_per_token():
    fit = StepCost()
    fit.observe(1, 0.030)
    fit.observe(3, 0.020)  # three tokens faster than one: noise
    assert fit.per_token_s == pytest.approx(0.050 / 4, rel=0.01)
    assert fit.fixed_s == 0.0 and not fit.resolved  # a fallback, and it says so
    fit.observe(9, 0.090)
    assert fit.resolved and fit.per_token_s > 0


def test_empty_and_negative_observations_are_ignored_and_the_decay_is_checked():
    fit = StepCost()
    fit.observe(0, 0.01)
    fit.observe(4, -1.0)
    assert fit.steps == 0
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="decay"):
            StepCost(bad)


def test_the_tail_is_what_one_step_in_ten_runs_over_the_fit():
    fit = StepCost()
    for i in range(MIN_TAIL_STEPS + 2):  # steps exactly as fitted: no tail
        n = 1 + i % 16
        fit.observe(n, 0.02 + 0.001 * n)
    assert fit.tail == 1.0
    rng = random.Random(1)
    for i in range(400):  # one step in five runs 1.5x over (a neighbour on the core), the rest as fitted
        n = 1 + i % 16
        fit.observe(n, (0.02 + 0.001 * n) * (1.5 if rng.random() < 0.2 else 1.0))
    assert fit.tail == pytest.approx(1.5, rel=0.1)
    assert fit.per_token_s is not None and fit.extra_seconds(40) == pytest.approx(0.040, rel=0.3)  # the fit stays a mean


def test_a_stall_on_a_step_shorter_than_the_floor_is_read_in_seconds_not_as_a_share():
    # a tiny model's ~1 ms steps, one in five stalled by 4 ms: a stall, not a 5x slower host
    fit, rng = StepCost(), random.Random(2)
    for i in range(400):
        n = 1 + i % 16
        fit.observe(n, 0.0005 + 0.00005 * n + (0.004 if rng.random() < 0.2 else 0.0))
    assert fit.stall_s == pytest.approx(0.004 - 0.2 * 0.004, rel=0.1)  # (the fit, a mean, took in a fifth of them)
    assert fit.tail == 1.0  # no step long enough to be stretched
    # the long steps of the same engine (a local prefill): stretched 1.5x one time in five
    for i in range(400):
        n = 200 + i % 16
        fit.observe(n, (0.0005 + 0.00005 * n) * (1.5 if rng.random() < 0.2 else 1.0))
    assert fit.tail == pytest.approx(1.5, rel=0.1)


def test_the_tail_is_one_until_enough_steps_were_seen_against_a_fit_and_never_below():
    fit = StepCost()
    for _ in range(100):  # one size: no fit, nothing to measure the steps against
        fit.observe(1, 0.05)
    assert fit.per_token_s is None and fit.tail == 1.0 and fit.stall_s == 0.0
    fit.observe(17, 0.05 + 0.016)
    for _ in range(MIN_TAIL_STEPS - 2):
        fit.observe(17, 0.2)  # far over: but too few steps to say so yet
    assert fit.tail == 1.0 and fit.stall_s == 0.0
    fast = StepCost()
    for i in range(300):  # a host that speeds up: steps under the fit
        n = 1 + i % 16
        fast.observe(n, (0.02 + 0.001 * n) * (1.0 if i < 100 else 0.7))
    assert fast.tail == 1.0
    quick = StepCost()
    for i in range(300):  # the same with steps under the floor: no stall
        n = 1 + i % 16
        quick.observe(n, (0.0005 + 0.00005 * n) * (1.0 if i < 100 else 0.7))
    assert quick.stall_s == 0.0
