"""Conditional disaggregation (`max_local_prefill_tokens`, `local_prefill_budget_ms`) on real
engines in one process: a prompt with few tokens its decode replica's prefix cache does not hold
(few by count, or by what computing them would add to a step) is prefilled on that replica; any
other goes through the prefill pool; both give the tokens colocated serving gives, and every
block is back when they are done."""

from __future__ import annotations

import pytest

from cluster.sampling_params import SamplingParams
from openai_helpers import run, serving_stack

LIMIT = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def pools(tiny_model_paths):
    with serving_stack(str(tiny_model_paths["llama"]), {"num_blocks": 64, "max_num_seqs": 8},
                       app={"max_local_prefill_tokens": LIMIT}) as s:
        yield s


@pytest.fixture(scope="module")
def budget_pools(tiny_model_paths):
    with serving_stack(str(tiny_model_paths["llama"]), {"num_blocks": 64, "max_num_seqs": 8},
                       app={"local_prefill_budget_ms": 30}) as s:
        yield s


class FixedCost:
    """A step-cost fit that stays where a test puts it (the real one follows the engine's steps)."""

    def __init__(self, per_token_s: float | None) -> None:
        self.per_token_s = per_token_s
        self.tail = 1.0
        self.stall_s = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        pass

    def extra_seconds(self, num_tokens: int) -> float | None:
        return None if self.per_token_s is None else self.per_token_s * num_tokens


def generate(pools, rid: str, prompt: list[int], disaggregated: bool = True,
             params: SamplingParams = GREEDY) -> tuple[list[int], dict]:
    """(the tokens, the trace) of one request on the disaggregated or the colocated decode server."""
    from cluster.prefill.server import LocalPrefillClient

    async def go():
        tokens, trace = [], {}
        server = pools["decode"] if disaggregated else pools["colocated_server"]
        client = LocalPrefillClient(pools["prefill"]) if disaggregated else None
        async for deltas in server.generate(rid, prompt, params, client):
            for d in deltas:
                tokens += d.token_ids
                trace = d.trace or trace
        return tokens, trace

    return run(go())


def test_only_prompts_with_few_uncached_tokens_skip_the_prefill_pool(pools):
    long_prompt = [(7 * i) % 500 + 3 for i in range(60)]
    cases = [("short", [5, 17, 29, 41, 53, 65, 77, 89, 101, 113], "short: prefilled here (10 uncached tokens)"),
             ("long", long_prompt, "landed"),
             # the next turn: the first 48 tokens are cached on decode now, 22 are left
             ("next-turn", long_prompt + [201, 202, 203, 204, 205, 206, 207, 208, 209, 210],
              "short: prefilled here (22 uncached tokens)")]
    sent = pools["prefill"].exporter.counters
    for name, prompt, kv in cases:
        before = sent["acked"]
        tokens, trace = generate(pools, name, prompt)
        assert trace["kv"] == kv, name
        assert sent["acked"] - before == (kv == "landed"), name  # the prefill pool saw it, or not
        assert tokens == generate(pools, f"{name}-colocated", prompt, disaggregated=False)[0], name
    # the same next turn, scored (prompt_logprobs): computed whole, so over the limit
    scored = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    _, trace = generate(pools, "scored", cases[2][1], params=scored)
    assert trace["kv"] == "landed"
    stats = run(pools["decode"].stats())
    assert stats["prefilled_locally_short"] == 2 and stats["blocks_in_use"] == 0
    assert run(pools["prefill"].stats())["blocks_in_use"] == 0


def test_the_threshold_is_validated_with_the_app_config():
    from cluster.app_config import AppConfig

    for bad in (-1, True, 1.5, "8"):
        with pytest.raises(ValueError, match="max_local_prefill_tokens must be an integer >= 0"):
            AppConfig.from_args({"max_local_prefill_tokens": bad})


def test_with_a_time_budget_a_prompt_is_prefilled_here_when_its_uncached_tokens_fit_in_it(budget_pools):
    decode = budget_pools["decode"]
    engine = decode.engine.engine
    real_fit = engine.step_cost
    long_prompt = [(11 * i) % 500 + 3 for i in range(60)]
    cases = [("short", [5, 17, 29, 41, 53, 65, 77, 89, 101, 113], "budget: prefilled here (10 uncached tokens, ~10 ms)"),
             ("long", long_prompt, "landed"),  # 60 tokens: ~60 ms > 30
             ("next-turn", long_prompt + [201, 202, 203, 204, 205, 206, 207, 208, 209, 210],
              "budget: prefilled here (22 uncached tokens, ~22 ms)")]  # 48 of its 70 cached here
    sent = budget_pools["prefill"].exporter.counters
    try:
        engine.step_cost = FixedCost(0.001)  # 1 ms a token
        for name, prompt, kv in cases:
            before = sent["acked"]
            tokens, trace = generate(budget_pools, name, prompt)
            assert trace["kv"] == kv, name
            assert sent["acked"] - before == (kv == "landed"), name
            assert tokens == generate(budget_pools, f"{name}-colocated", prompt, disaggregated=False)[0], name
        engine.step_cost = FixedCost(0.004)  # a slower host: a next turn as long (22 tokens, ~88 ms) is sent
        _, trace = generate(budget_pools, "next-turn-slow", long_prompt + list(range(301, 311)))
        assert trace["kv"] == "landed"
        engine.step_cost = FixedCost(None)  # cost unknown: nothing is prefilled here on a guess
        _, trace = generate(budget_pools, "short-unknown", [9, 8, 7])
        assert trace["kv"] == "landed"
    finally:
        engine.step_cost = real_fit
    stats = run(decode.stats())
    assert stats["prefilled_locally_budget"] == 2 and "prefilled_locally_short" not in stats
    assert stats["blocks_in_use"] == 0


def test_a_decode_replica_with_a_budget_measures_its_steps_before_its_first_request(tiny_model_paths):
    """Calibration at start: the fit knows a cost per token, and nothing a user could see moved
    (no prompt tokens or prefix-cache figures counted, no throwaway blocks left in the cache)."""
    from cluster.app_config import AppConfig
    from cluster.decode.server import DecodeServer

    args = {"model": str(tiny_model_paths["llama"]), "engine": {"num_blocks": 64},
            "kv_transfer": {"connector": "tcp"}, "local_prefill_budget_ms": 30}
    server = DecodeServer(AppConfig.from_args(args))
    try:
        engine = server.engine.engine
        assert engine.step_cost.per_token_s > 0 and engine.step_cost.steps == 4
        stats = run(server.stats())
        assert stats["step_s_per_token"] == engine.step_cost.per_token_s
        assert stats.get("prompt_tokens", 0) == 0 and not any(k.startswith("finished_") for k in stats)
        assert stats["prefix_cache_queries"] == 0 and stats["blocks_in_use"] == 0
        assert not engine.blocks.cached and engine.blocks.num_free_blocks == 64
        assert not engine.scheduler.requests
    finally:
        server.close()


def test_the_budget_is_validated_with_the_app_config():
    from cluster.app_config import AppConfig

    assert AppConfig.from_args({"local_prefill_budget_ms": 25}).local_prefill_budget_ms == 25
    for bad in (-1, True, "8", float("nan"), float("inf")):
        with pytest.raises(ValueError, match="local_prefill_budget_ms must be a number >= 0"):
            AppConfig.from_args({"local_prefill_budget_ms": bad})


@pytest.fixture(scope="module")
def slo_pools(tiny_model_paths):
    with serving_stack(str(tiny_model_paths["llama"]), {"num_blocks": 64, "max_num_seqs": 8},
                       app={"ttft_slo_ms": 1000, "itl_slo_ms": 50}) as s:
        yield s


class PinnedCost(FixedCost):
    def __init__(self, fixed_s: float | None, per_token_s: float | None) -> None:
        super().__init__(per_token_s)
        self.fixed_s = fixed_s


def test_with_slos_each_prompt_is_prefilled_where_the_estimates_keep_them(slo_pools):
    """Pinned costs (decode 30 ms + 1 ms a token, the prefill pool 40 ms + 1 ms a token, idle):
    10 uncached tokens here cost ~40 ms before the first token and keep the 50 ms ITL SLO, the
    prefill pool ~90 ms: here. 60 tokens here would make the streams' step ~90 ms: the pool."""
    decode = slo_pools["decode"]
    engine = decode.engine.engine
    real_fit = engine.step_cost
    pool = [{"queued_work": [], "step_fixed_s": 0.040, "step_s_per_token": 0.001, "max_num_batched_tokens": 512}]
    short, long_prompt = [5, 17, 29, 41, 53, 65, 77, 89, 101, 113], [(13 * i) % 500 + 3 for i in range(60)]
    try:
        engine.step_cost = PinnedCost(0.030, 0.001)
        _, trace = generate(slo_pools, "unknown-pool", short)
        assert trace["kv"] == "landed" and trace["placement_reason"] == "costs not measured yet"
        decode.observe_prefill_pool(pool)
        for name, prompt, where in (("short", short, "local"), ("long", long_prompt, "remote")):
            tokens, trace = generate(slo_pools, name, prompt)
            assert trace["placement"] == where, (name, trace)
            assert trace["kv"] == ("slo: prefilled here (10 uncached tokens)" if where == "local" else "landed")
            assert trace["local_ttft_ms"] == pytest.approx(40.0 if where == "local" else 90.0)
            assert tokens == generate(slo_pools, f"{name}-colocated", prompt, disaggregated=False)[0], name
        # a host where 1 step in 10 ran 1.5x over the fit: the short prompt's 40 ms step would be
        # 60 ms in that tail, over the ITL SLO: the pool
        engine.step_cost.tail = 1.5
        _, trace = generate(slo_pools, "short-busy-host", short)
        assert trace["placement"] == "remote" and trace["kv"] == "landed", trace
        assert trace["step_tail"] == 1.5 and trace["local_itl_ms"] == pytest.approx(60.0)
        engine.step_cost.tail = 1.0
        # its steps stalled 15 ms (9 in 10): 55 ms, over the SLO too; 5 ms: 45 ms, here again
        for stall_s, where in ((0.015, "remote"), (0.005, "local")):
            engine.step_cost.stall_s = stall_s
            _, trace = generate(slo_pools, f"short-stalled-{stall_s}", short)
            assert trace["placement"] == where and trace["step_stall_ms"] == stall_s * 1e3, trace
            assert trace["local_itl_ms"] == pytest.approx(40.0 + stall_s * 1e3)
        engine.step_cost.stall_s = 0.0
        # the prefill pool's queue fills up (2,000 shorter tokens ahead): the long one stays here now
        decode.observe_prefill_pool([{**pool[0], "queued_work": [50] * 40}])
        _, trace = generate(slo_pools, "long-busy-pool", [(17 * i) % 500 + 3 for i in range(60)])
        assert trace["placement"] == "local" and trace["remote_ttft_ms"] > 1000
    finally:
        engine.step_cost = real_fit
    stats = run(decode.stats())
    assert stats["prefilled_locally_slo"] == 3 and stats["blocks_in_use"] == 0  # short, short-stalled-0.005, long-busy-pool
    assert run(slo_pools["prefill"].stats())["blocks_in_use"] == 0


def test_the_prefill_pools_estimate_counts_what_a_hand_off_costs_around_the_pools_compute(slo_pools):
    """A prefill pool whose own compute is cheap (1 ms + 0.1 ms a token, idle) beats this
    replica's 40 ms for a 10-token prompt, until hand-offs are seen to cost more than that around
    the pool's queue and compute (here a call that takes 300 ms to reach it: a busy event loop, a
    slow network): each request's trace shows what its hand-off cost beyond the pool's compute,
    the estimate of the next one counts their recent average (one in five of the last), and the
    prompt stays here."""
    import asyncio

    from cluster.prefill.server import LocalPrefillClient

    decode = slo_pools["decode"]
    engine = decode.engine.engine
    real_fit, real_handoff = engine.step_cost, decode._handoff_s
    pool = {"queued_work": [], "step_fixed_s": 0.001, "step_s_per_token": 0.0001, "max_num_batched_tokens": 512}

    class SlowCall(LocalPrefillClient):
        async def prefill(self, *args, **kwargs):
            await asyncio.sleep(0.3)
            return await super().prefill(*args, **kwargs)

    async def one(rid: str, prompt: list[int], client) -> dict:
        trace = {}
        async for deltas in decode.generate(rid, prompt, GREEDY, client):
            trace = next((d.trace for d in deltas if d.trace), trace)
        return trace

    try:
        engine.step_cost = PinnedCost(0.030, 0.001)
        decode._handoff_s = 0.002  # hand-offs in one process, lately: ~ms
        decode.observe_prefill_pool([pool])
        trace = run(one("fast-call", [7 * i + 5 for i in range(10)], LocalPrefillClient(slo_pools["prefill"])))
        assert trace["placement"] == "remote" and trace["local_ttft_ms"] == pytest.approx(40.0), trace
        assert 0 < trace["handoff_s"] < 0.3
        trace = run(one("slow-call", [7 * i + 9 for i in range(10)], SlowCall(slo_pools["prefill"])))
        assert trace["placement"] == "remote" and trace["handoff_s"] >= 0.3, trace
        # the recent average now holds ~60 ms of hand-off: the pool's first token ~92 ms, here 40
        trace = run(one("after-a-slow-call", [11 * i + 3 for i in range(10)], LocalPrefillClient(slo_pools["prefill"])))
        assert trace["placement"] == "local" and trace["remote_ttft_ms"] > 80, trace
        assert trace["kv"] == "slo: prefilled here (10 uncached tokens)"
    finally:
        engine.step_cost, decode._handoff_s = real_fit, real_handoff


def test_a_prompt_sent_to_the_prefill_pool_counts_in_its_queue_until_a_report_shows_it_or_it_is_back(slo_pools):
    """The pool's reports arrive a while after they were collected: a prompt sent since (a long
    one placed remote a moment ago) is in the pool's work the next placement sees, not forgotten:
    sent to an idle pool it started at once, so a shorter prompt sent after it waits for all of
    it; sent to a busy one it waits in the queue. Once its prefill is back it is out of the pool's
    way, report or not."""
    import asyncio
    import dataclasses
    import time

    from cluster.decode.placement import estimate_remote
    from cluster.prefill.server import LocalPrefillClient

    decode = slo_pools["decode"]
    engine = decode.engine.engine
    real_fit = engine.step_cost
    pool = {"queued_work": [], "step_fixed_s": 0.040, "step_s_per_token": 0.001, "max_num_batched_tokens": 512}

    class Held(LocalPrefillClient):  # the pool computes the prompt when the test lets it
        def __init__(self, server) -> None:
            super().__init__(server)
            self.called, self.go = asyncio.Event(), asyncio.Event()

        async def prefill(self, *args, **kwargs):
            self.called.set()
            await self.go.wait()
            return await super().prefill(*args, **kwargs)

    async def go() -> dict:
        client = Held(slo_pools["prefill"])
        prompt = [(11 * i) % 500 + 3 for i in range(60)]

        async def stream() -> dict:
            trace = {}
            async for deltas in decode.generate("sent", prompt, GREEDY, client):
                trace = next((d.trace for d in deltas if d.trace), trace)
            return trace

        task = asyncio.ensure_future(stream())
        await client.called.wait()
        view = decode._placement_inputs(10).prefill
        assert view.running == (60,) and view.queued == ()  # the pool was idle: it runs there now
        # a 10-token prompt now would wait for all 60 there: ~40 ms + 70 tokens, not 40 ms + 10
        alone = dataclasses.replace(decode._placement_inputs(10), prefill=dataclasses.replace(view, running=()))
        assert estimate_remote(decode._placement_inputs(10)) == pytest.approx(estimate_remote(alone) + 0.060)
        # a report collected before that prompt was sent, read only now: the prompt still counts
        decode.observe_prefill_pool([{**pool, "posted_at": time.time() - 5.0}])
        assert decode._placement_inputs(60).prefill.running == (60,)
        # a pool busy with a prompt of its own when it posted: this one waits in its queue
        decode.observe_prefill_pool([{**pool, "running_work": [500], "posted_at": time.time() - 5.0}])
        view = decode._placement_inputs(60).prefill
        assert view.running == (500,) and view.queued == (60,)
        client.go.set()
        trace = await task
        view = decode._placement_inputs(60).prefill
        assert view.queued == () and view.running == (500,)  # back: no report needed
        return trace

    try:
        engine.step_cost = PinnedCost(0.030, 0.001)
        time.sleep(0.2)  # whatever earlier tests sent there is in the next report
        decode.observe_prefill_pool([{**pool, "posted_at": time.time()}])
        assert run(go())["placement"] == "remote"
        # one sent and not back, then a report collected after it (where `queued_work` holds it
        # while it is there): it counts once, in the report
        decode._sent_since_report["lost"] = (time.time(), 60)
        time.sleep(0.2)
        decode.observe_prefill_pool([{**pool, "queued_work": [60], "posted_at": time.time()}])
        view = decode._placement_inputs(60).prefill
        assert view.queued == (60,) and view.running == ()
    finally:
        engine.step_cost = real_fit
        decode._sent_since_report.pop("lost", None)


def test_the_slos_are_validated_with_the_app_config():
    from cluster.app_config import AppConfig

    assert AppConfig.from_args({"ttft_slo_ms": 800, "itl_slo_ms": 120}).itl_slo_ms == 120
    for name in ("ttft_slo_ms", "itl_slo_ms"):
        for bad in (-1, True, "8", float("inf")):
            with pytest.raises(ValueError, match=f"{name} must be a number >= 0"):
                AppConfig.from_args({name: bad})


def test_prefill_torch_threads_is_validated_with_the_app_config():
    from cluster.app_config import AppConfig

    assert AppConfig.from_args({"prefill_torch_threads": 2}).prefill_torch_threads == 2
    for bad in (0, True, 1.5, "2"):
        with pytest.raises(ValueError, match="prefill_torch_threads must be an integer >= 1"):
            AppConfig.from_args({"prefill_torch_threads": bad})


def test_a_decode_replica_looks_for_the_prefill_pool_from_its_start_until_it_sees_it(monkeypatch):
    """Placement by SLO is blind (every prompt to the pool) until the decode replica has read the
    prefill pool's posts, and both pools start together: it reads them from its start (its
    constructor starts the watch, started by hand here), again every 50 ms until the pool's first
    post is there, then every period."""
    import asyncio
    import time

    from cluster.decode import deployment
    from cluster.stats_board import PERIOD_S

    reads: list[float] = []

    class Board:
        class read_pool:  # noqa: N801 (a Ray actor method's shape: .remote(...) → awaitable)
            @staticmethod
            async def remote(pool, keys):
                reads.append(time.monotonic())
                posted = len(reads) > 3  # the prefill replica's first post lands after three reads
                return [{"step_fixed_s": 0.02, "step_s_per_token": 0.001, "posted_at": time.time()}] if posted else []

    class Server:
        places_by_slo = True
        seen = None

        @property
        def has_seen_prefill_pool(self):
            return self.seen is not None

        def observe_prefill_pool(self, replicas):
            if replicas and self.seen is None:
                self.seen = time.monotonic()

        def close(self):
            pass

    monkeypatch.setattr(deployment, "board", lambda app: Board())
    replica = deployment.DecodeDeployment.func_or_class.__new__(deployment.DecodeDeployment.func_or_class)
    replica.server, replica.app_name, replica.prefill, replica._watcher = Server(), "app", object(), None

    async def go():
        replica._ensure_watching()
        await asyncio.sleep(0.2 + PERIOD_S)
        replica._watcher.cancel()

    asyncio.run(go())
    gaps = [b - a for a, b in zip(reads, reads[1:])]
    assert replica.server.seen is not None and replica.server.seen - reads[0] < 0.5 * PERIOD_S
    assert all(g < 0.5 * PERIOD_S for g in gaps[:3]) and gaps[3] >= 0.9 * PERIOD_S
