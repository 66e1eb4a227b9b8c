"""Placement by SLO (cluster/decode/placement.py) with pinned step costs: each branch of the
decision, and the estimates it rests on worked out by hand."""

import dataclasses

import pytest

from cluster.decode.placement import PlacementInputs, PrefillPoolView, StepCosts, estimate_local, estimate_remote, place

DECODE = StepCosts(fixed_s=0.030, per_token_s=0.001)
PREFILL = StepCosts(fixed_s=0.040, per_token_s=0.001)
TTFT_SLO, ITL_SLO = 1.0, 0.150


def inputs(uncached: int, queued=(), running: int = 8, waiting_tokens: int = 0, replicas: int = 1,
           decode=DECODE, prefill=PREFILL, started=()) -> PlacementInputs:
    pool = PrefillPoolView(prefill, tuple(queued), replicas, step_budget=512, running=tuple(started)) if prefill else None
    return PlacementInputs(uncached, decode, running, waiting_tokens, 512, pool, handoff_s=0.010)


def test_the_estimates_by_hand():
    inp = inputs(100, queued=(50, 300, 2000), running=8, waiting_tokens=20, started=(700,))
    ttft, itl = estimate_local(inp)
    # one step of 20 + 100 prompt tokens beside 8 streams: 30 ms + 128 x 1 ms
    assert ttft == pytest.approx(0.030 + 0.128) and itl == pytest.approx(0.030 + 0.128)
    # remote: the rest of the prompt being computed there (700 tokens: it runs to its end), the
    # 50-token prompt queued (shorter: it goes first; the longer ones wait), then ours: 850
    # tokens in 2 steps of the prefill pool, the transfer, one decode step to join
    assert estimate_remote(inp) == pytest.approx(2 * 0.040 + 0.850 + 0.010 + 0.030 + 0.008)
    assert estimate_remote(inputs(100, queued=(50, 300, 2000))) == pytest.approx(0.040 + 0.150 + 0.048)


def test_a_long_queue_is_shared_by_the_replicas():
    assert PrefillPoolView(PREFILL, (100, 100, 100, 100), 2, 512).ahead_of(200) == 200
    assert PrefillPoolView(PREFILL, (100, 900), 2, 512, running=(600, 200)).ahead_of(200) == 450


def test_costs_not_measured_yet_go_remote():
    assert place(inputs(12, decode=None), TTFT_SLO, ITL_SLO).where == "remote"
    assert place(inputs(12, prefill=None), TTFT_SLO, ITL_SLO).where == "remote"


def test_a_short_prompt_both_can_serve_goes_where_its_first_token_comes_first():
    p = place(inputs(12), TTFT_SLO, ITL_SLO)
    assert p.where == "local" and p.local_ttft_s < p.remote_ttft_s
    assert "both keep" in p.reason
    # a busy decode replica (a queue of its own) and an idle prefill pool: the pool is sooner
    p = place(inputs(12, waiting_tokens=600, running=2), 5.0, 5.0)
    assert p.where == "remote" and p.remote_ttft_s < p.local_ttft_s


def test_a_long_prompt_that_would_stall_the_streams_goes_remote():
    p = place(inputs(800), TTFT_SLO, ITL_SLO)
    assert p.where == "remote" and p.local_itl_s > ITL_SLO >= p.itl_s
    assert p.reason == "only this one keeps the SLOs"


def test_a_prompt_whose_step_keeps_the_itl_slo_on_the_fit_but_not_in_the_replicas_tail_goes_remote():
    # 8 streams and 100 prompt tokens: 30 + 108 x 1 = 138 ms by the fit, under the 150 ms SLO
    assert place(inputs(100), TTFT_SLO, ITL_SLO).where == "local"
    # the replica's steps ran up to 1.2x over their fit lately (9 in 10): 166 ms, over it
    p = place(inputs(100, decode=StepCosts(0.030, 0.001, tail=1.2)), TTFT_SLO, ITL_SLO)
    assert p.where == "remote" and p.reason == "only this one keeps the SLOs"
    assert p.local_itl_s == pytest.approx(0.138 * 1.2)
    assert p.itl_s == pytest.approx(0.038)  # the streams' own step: the fit, nothing added here
    # the first token's estimate is a sum of steps: the fit's, tail or not
    assert p.local_ttft_s == place(inputs(100), TTFT_SLO, ITL_SLO).local_ttft_s


def test_a_stall_of_short_steps_is_added_to_a_prompts_step_not_multiplied_into_it():
    # a tiny model's replica: 7 ms steps at 64 streams, whose 9 in 10 stalled up to 26 ms; a
    # burst's 400 queued prompt tokens make a 40 ms step beside the streams
    tiny = StepCosts(0.001, 0.0001, stall_s=0.026)
    p = place(inputs(25, decode=tiny, running=64, waiting_tokens=375), TTFT_SLO, ITL_SLO)
    assert p.local_itl_s == pytest.approx(tiny.step_s(64 + 400) + 0.026)  # 73 ms, not 3.6x 47 ms
    assert p.where == "local"
    # a long step on a host that stretches steps 1.2x: the larger of the two reads
    both = StepCosts(0.030, 0.001, tail=1.2, stall_s=0.010)
    assert both.tail_step_s(108) == pytest.approx(0.138 * 1.2)
    assert both.tail_step_s(0) == pytest.approx(0.030 + 0.010)


def test_a_short_prompt_behind_a_long_prefill_queue_stays_local():
    p = place(inputs(30, queued=[25] * 60), TTFT_SLO, ITL_SLO)  # 1,500 shorter tokens queued there
    assert p.where == "local" and p.remote_ttft_s > TTFT_SLO and p.local_itl_s <= ITL_SLO


def test_when_neither_keeps_the_slos_a_stall_of_many_streams_is_not_traded_for_one_first_token():
    # the pool's queue breaks the TTFT SLO 3.5x; here the first token is on time, but the prompt's
    # step breaks the ITL SLO of 16 streams (by less: 1.3x). One late first token against 16
    # breaches: remote
    p = place(inputs(150, queued=[100] * 30, running=16), TTFT_SLO, ITL_SLO)
    assert p.local_ttft_s <= TTFT_SLO < p.remote_ttft_s and p.local_itl_s > ITL_SLO >= p.itl_s
    assert p.local_itl_s / ITL_SLO < p.remote_ttft_s / TTFT_SLO  # the smaller breach is here's
    assert p.where == "remote" and p.reason == "neither keeps the SLOs: here would break more requests"
    # a prompt so long that prefilling it here breaks its own first token and the streams' ITL
    p = place(inputs(3000, running=16), TTFT_SLO, ITL_SLO)  # ~3 s of prefill anywhere
    assert p.where == "remote" and p.reason.startswith("neither")


def test_when_neither_keeps_the_slos_and_both_break_one_request_the_smaller_breach_wins():
    # the same prompt beside one stream: its ITL against the prompt's first token, one each
    p = place(inputs(150, queued=[100] * 30, running=1), TTFT_SLO, ITL_SLO)
    assert p.local_itl_s > ITL_SLO and p.remote_ttft_s > TTFT_SLO >= p.local_ttft_s
    assert p.where == "local" and p.reason == "neither keeps the SLOs: the smaller breach"
    # no stream running: the prompt's long step delays the one that arrives meanwhile, as one
    idle = inputs(250, queued=[100] * 30, running=0, decode=StepCosts(0.030, 0.001, tail=1.5))
    p = place(idle, TTFT_SLO, ITL_SLO)
    assert p.local_itl_s > ITL_SLO and p.where == "local" and p.reason.endswith("the smaller breach")
    # but with requests bound here (queued, or their KV on its way from the pool), they join the
    # streams its steps stall: the pool
    p = place(dataclasses.replace(idle, coming=6), TTFT_SLO, ITL_SLO)
    assert p.where == "remote" and p.reason == "neither keeps the SLOs: here would break more requests"
    # both first tokens late, the streams' ITL kept here (steps cut to it): one each, the later
    # first token loses
    p = place(capped(100, waiting_tokens=3000, queued=[100] * 40, running=8), TTFT_SLO, ITL_SLO)
    assert p.local_ttft_s > TTFT_SLO and p.remote_ttft_s > TTFT_SLO and p.local_itl_s <= ITL_SLO
    assert p.reason.endswith("the smaller breach")
    assert p.where == ("local" if p.local_ttft_s < p.remote_ttft_s else "remote")


def test_the_trace_shows_the_decision_and_its_inputs():
    t = place(inputs(12), TTFT_SLO, ITL_SLO).trace()
    assert t["placement"] == "local" and {"local_ttft_ms", "local_itl_ms", "remote_ttft_ms", "itl_ms"} <= set(t)


def capped(uncached: int, **kw) -> PlacementInputs:
    """The same inputs from an engine that cuts its steps to the ITL SLO while streams decode."""
    return dataclasses.replace(inputs(uncached, **kw), max_step_s=ITL_SLO)


def test_with_steps_cut_to_the_itl_slo_a_long_prompt_costs_more_steps_and_keeps_the_streams_itl():
    # 150 ms steps beside 8 streams: (150 - 30) / 1 - 8 = 112 prompt tokens each; 600 tokens in 6
    ttft, itl = estimate_local(capped(600))
    assert itl == pytest.approx(0.030 + 0.120) and itl <= ITL_SLO
    assert ttft == pytest.approx(6 * 0.030 + 0.001 * (600 + 6 * 8))
    uncut_ttft, uncut_itl = estimate_local(inputs(600))  # one 512-token step and a second one
    assert uncut_itl > ITL_SLO and uncut_ttft < ttft


def test_with_steps_cut_a_long_prompt_behind_a_busy_prefill_pool_is_prefilled_here():
    # the prefill pool is computing a longer prompt, 1,500 tokens to go: remote misses the TTFT SLO; here,
    # in 150 ms steps, it keeps both SLOs
    p = place(capped(500, started=(1500,)), TTFT_SLO, ITL_SLO)
    assert p.where == "local" and p.local_ttft_s <= TTFT_SLO < p.remote_ttft_s and p.local_itl_s <= ITL_SLO
    # without the cut the same prompt's 512-token step breaks the ITL SLO: the smaller breach
    assert place(inputs(500, started=(1500,)), TTFT_SLO, ITL_SLO).reason.startswith("neither")


def test_with_no_stream_decoding_steps_are_not_cut():
    assert estimate_local(capped(600, running=0)) == estimate_local(inputs(600, running=0))


def test_with_steps_cut_a_long_prompt_both_could_serve_goes_remote_to_spare_the_streams():
    # an idle prefill pool: 600 tokens remote in ~0.73 s; here in six cut steps, ~0.83 s. Both
    # keep the SLOs, and remote leaves the streams' steps alone
    p = place(capped(600), TTFT_SLO, ITL_SLO)
    assert p.local_ttft_s <= TTFT_SLO and p.remote_ttft_s <= TTFT_SLO
    assert p.where == "remote" and "stall" in p.reason
    # a prompt one cut step holds still goes where its first token comes first
    assert place(capped(12), TTFT_SLO, ITL_SLO).where == "local"


def test_prompts_sent_since_the_pool_posted_run_on_an_idle_replica_and_queue_on_a_busy_one():
    view = PrefillPoolView(PREFILL, (), 2, step_budget=512, running=(300,))
    sent = view.plus_sent([600, 40, 20])  # one replica idle: the first sent started there
    assert sent.running == (300, 600) and sent.queued == (40, 20)
    assert sent.ahead_of(30) == (20 + 300 + 600) / 2  # a short one waits for both running prompts
    busy = PrefillPoolView(PREFILL, (50,), 2, step_budget=512).plus_sent([600])  # a queue: nobody idle
    assert busy.running == () and busy.queued == (50, 600)


def test_when_a_short_prompt_passes_running_ones_it_waits_for_one_chunk_of_the_longer():
    """prefill_schedule ttft: a prompt part way through its chunks is passed between steps, so a
    short prompt waits for the shorter prompts and for the chunk in progress, not the whole rest."""
    view = PrefillPoolView(PREFILL, (50, 400), 1, step_budget=512, running=(900, 20), chunk=128,
                           passes_running=True)
    assert view.ahead_of(60) == 50 + 20 + 128
    assert view.ahead_of(1000) == 50 + 400 + 900 + 20  # a longer one still waits for all of them
    runs_to_end = PrefillPoolView(PREFILL, (50, 400), 1, step_budget=512, running=(900, 20), chunk=128)
    assert runs_to_end.ahead_of(60) == 50 + 900 + 20


def test_the_chunk_cap_counts_steps_on_both_sides():
    pool = PrefillPoolView(PREFILL, (), 1, step_budget=512, running=(900,), chunk=128, passes_running=True)
    inp = PlacementInputs(100, DECODE, 8, 0, 512, pool, handoff_s=0.010, chunk=64)
    # remote: the chunk in progress (128) and ours (100) in steps of 128: 2 steps
    assert estimate_remote(inp) == pytest.approx(2 * 0.040 + 0.228 + 0.010 + 0.038)
    # local: 100 tokens in steps of at most 64 beside 8 streams: 2 steps, each carrying the streams
    ttft, itl = estimate_local(inp)
    assert ttft == pytest.approx(2 * 0.030 + 0.001 * (100 + 2 * 8)) and itl == pytest.approx(0.030 + 0.001 * 72)
    # a prompt too long for the streams' step: behind the long one's chunk, the pool keeps the
    # TTFT SLO; had the long one run to its end first, it would not
    p = place(PlacementInputs(400, DECODE, 8, 0, 512, pool, 0.010), TTFT_SLO, ITL_SLO)
    assert p.where == "remote" and p.reason == "only this one keeps the SLOs"
    to_end = PrefillPoolView(PREFILL, (), 1, step_budget=512, running=(900,), chunk=128)
    assert place(PlacementInputs(400, DECODE, 8, 0, 512, to_end, 0.010), TTFT_SLO, ITL_SLO).remote_ttft_s > TTFT_SLO
