"""Goodput under open-loop load: Poisson arrivals, SLO attainment, requests/s that meet both SLOs.

A request meets the SLO when it finished without error, its TTFT ≤ `Slo.ttft_ms` and its TPOT
≤ `Slo.tpot_ms` (cluster/loadgen.py defines both; a reply of one token has no TPOT and passes
that half). Goodput is the number of such requests over the run's wall time (first send to last
byte), as DistServe and vLLM's serving bench count it; attainment is their share of all sent.

Arrivals are open-loop: request i is due at `offsets[i]` seconds after the start whatever the
server does, and its TTFT counts from then. At most `max_concurrency` are in flight; one that
waits for a free slot waits on the user's clock (a client-side queue is still a queue). Every
request opens its own connection, as separate users would (llama-server also closes a
connection after a stream while announcing keep-alive).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import aiohttp

from cluster.loadgen import Sample, latency_summary, percentile, stream_one, tpot_s


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float


def poisson_offsets(rate: float, n: int, seed: int) -> list[float]:
    """n send times (s from the start) of a Poisson process at `rate` req/s: the first at 0,
    then exponential gaps of mean 1/rate."""
    if rate <= 0 or n < 1:
        raise ValueError(f"need rate > 0 and n >= 1, got rate={rate}, n={n}")
    rng = random.Random(seed)
    offsets, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


def meets_slo(sample: Sample, slo: Slo) -> bool:
    if sample.error is not None or sample.ttft_s is None:
        return False
    tpot = tpot_s(sample)
    return sample.ttft_s * 1000 <= slo.ttft_ms and (tpot is None or tpot * 1000 <= slo.tpot_ms)


def goodput_summary(samples: Sequence[Sample], wall_s: float, slo: Slo) -> dict[str, Any]:
    """Attainment, goodput and the per-user speed (1 / TPOT p50) beside loadgen's latency summary."""
    met = sum(meets_slo(s, slo) for s in samples)
    ok = [s for s in samples if s.error is None]
    ttft_met = sum(s.ttft_s is not None and s.ttft_s * 1000 <= slo.ttft_ms for s in ok)
    tpot_met = sum((t := tpot_s(s)) is None or t * 1000 <= slo.tpot_ms for s in ok)
    tpot_p50 = percentile([t for s in ok if (t := tpot_s(s)) is not None], 50)
    n = len(samples)
    return {
        "slo_met": met,
        "attainment": round(met / n, 3) if n else None,
        "ttft_attainment": round(ttft_met / n, 3) if n else None,
        "tpot_attainment": round(tpot_met / n, 3) if n else None,
        "goodput_rps": round(met / wall_s, 4) if wall_s > 0 else None,
        "tok_s_per_user": round(1 / tpot_p50, 2) if tpot_p50 else None,
        **latency_summary(list(samples), wall_s),
    }


async def run_open_loop(url: str, model: str, requests: Sequence[tuple[str, int]], offsets: Sequence[float], *,
                        max_concurrency: int, api_key: str | None = None,
                        on_done: Callable[[Sample], None] | None = None) -> tuple[list[Sample], float]:
    """Send request i = (prompt, max_tokens) at offsets[i]; return the samples (in request
    order, TTFT counted from the due time) and the wall time from the start to the last byte."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    slots = asyncio.Semaphore(max_concurrency)
    connector = aiohttp.TCPConnector(limit=max_concurrency + 1, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=1800)) as session:
        start = time.perf_counter()

        async def one(prompt: str, max_tokens: int, offset: float) -> Sample:
            due = start + offset
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            async with slots:
                sample = await stream_one(session, url, model, prompt, max_tokens, headers)
            sample.sent_at = due
            if on_done is not None:
                on_done(sample)
            return sample

        samples = await asyncio.gather(*(one(p, m, t) for (p, m), t in zip(requests, offsets)))
        wall = time.perf_counter() - start
    return list(samples), wall
