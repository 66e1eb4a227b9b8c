"""Goodput arithmetic on hand-timed samples, the Poisson arrivals' statistics, and the open-loop
client's clock: a request that waits for a free slot waits on the user's time."""

from __future__ import annotations

import asyncio
import json
import statistics

import pytest
from aiohttp import web

from cluster.goodput import Slo, goodput_summary, meets_slo, poisson_offsets, run_open_loop
from cluster.loadgen import Sample

SLO = Slo(ttft_ms=1000, tpot_ms=150)


def sample(ttft: float, gaps: list[float], error: str | None = None) -> Sample:
    """Sent at t=10 s; first text chunk `ttft` later, one token per chunk after `gaps`."""
    times = [10.0 + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return Sample(prompt_words=3, sent_at=10.0, chunk_times=times, completion_tokens=len(times), error=error)


#               TTFT ms   TPOT ms          meets both
HAND_TIMED = [
    sample(0.5, [0.1, 0.1]),         # 500      100              yes
    sample(1.2, [0.1, 0.1]),         # 1200     100              no: TTFT
    sample(0.2, [0.3]),              # 200      300              no: TPOT
    sample(0.2, [0.1], "HTTP 503"),  # an error                  no
    sample(0.3, []),                 # 300      (one token)      yes
    sample(1.0, [0.1, 0.2]),         # 1000     150 (the bounds) yes
]


def test_a_request_meets_the_slo_when_both_latencies_are_within_it():
    assert [meets_slo(s, SLO) for s in HAND_TIMED] == [True, False, False, False, True, True]


def test_goodput_counts_requests_meeting_both_slos_per_second_of_wall_time():
    got = goodput_summary(HAND_TIMED, wall_s=20.0, slo=SLO)
    assert got["slo_met"] == 3
    assert got["goodput_rps"] == pytest.approx(3 / 20)
    assert got["attainment"] == pytest.approx(3 / 6, abs=1e-3)
    assert got["ttft_attainment"] == pytest.approx(4 / 6, abs=1e-3)  # the error counts as a miss
    assert got["tpot_attainment"] == pytest.approx(4 / 6, abs=1e-3)
    assert got["errors"] == 1
    # TPOTs of the five answered: 100, 100, 300, 150 ms (the one-token reply has none) → p50 100 ms
    assert got["tok_s_per_user"] == pytest.approx(10.0)
    assert got["completion_tokens"] == 3 + 3 + 2 + 1 + 3


def test_poisson_gaps_have_the_rate_s_mean_and_an_exponential_spread():
    rate = 2.0
    offsets = poisson_offsets(rate, 20_001, seed=3)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(g > 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(1 / rate, rel=0.05)  # exponential: sd = mean
    assert offsets == poisson_offsets(rate, 20_001, seed=3)
    with pytest.raises(ValueError):
        poisson_offsets(0.0, 10, seed=0)


def test_a_request_queued_for_a_slot_counts_the_wait_in_its_ttft():
    """One slot, a server that answers 0.3 s after each request arrives: two requests due at
    t=0 and one due at 1.0 s. The second waits for the first, so its TTFT is ~0.6 s; the third
    finds the slot free and is sent on time."""
    async def scenario() -> tuple[list[Sample], list[float]]:
        arrived: list[float] = []

        async def chat(request: web.Request) -> web.StreamResponse:
            arrived.append(asyncio.get_running_loop().time())
            await request.json()
            await asyncio.sleep(0.3)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(2):
                chunk = {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "length" if i else None}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"choices": [], "usage": {"completion_tokens": 2}}
            await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            return resp

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            samples, _ = await run_open_loop(f"http://127.0.0.1:{port}", "m", [("a", 2), ("b", 2), ("c", 2)],
                                             [0.0, 0.0, 1.0], max_concurrency=1)
        finally:
            await runner.cleanup()
        return samples, arrived

    samples, arrived = asyncio.run(scenario())
    ttfts = sorted(s.ttft_s for s in samples)
    assert all(s.error is None for s in samples)
    assert ttfts[0] == pytest.approx(0.3, abs=0.15) and ttfts[1] == pytest.approx(0.3, abs=0.15)
    assert ttfts[2] == pytest.approx(0.6, abs=0.15)
    assert arrived[2] - arrived[0] == pytest.approx(1.0, abs=0.15)
