"""Load for an OpenAI-compatible server: named workloads, a streaming HTTP client that times
every chunk, and the summary the benches print (used by bench/serve.py; works against any
server speaking /v1/chat/completions, vLLM's included).

What is measured, per request, from the client's side of the socket:
  TTFT  send → first chunk carrying generated text (a role-only first chunk does not count)
  ITL   gap between consecutive chunks carrying text: the stall a reader sees. A server that
        coalesces k tokens into one chunk shows one gap for k tokens, so this is never kinder
        than per-token timing; `tokens_per_chunk` says how much coalescing happened.
  TPOT  (last chunk − first chunk) / (completion tokens − 1)
Throughput is completion tokens (from usage) over the workload's wall time. Every request
sets `ignore_eos` so each one generates exactly `max_tokens`, whatever the server.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Coroutine, TypeVar

import aiohttp
import uvloop

T = TypeVar("T")


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    concurrency: int
    max_tokens: int = 64
    long_every: int = 0      # every k-th request carries a long prompt (0: none)
    long_words: int = 600
    short_words: int = 0     # a short prompt carries this many words of its own (0: a one-line ask)


WORKLOADS = {
    "single": Workload("single", num_requests=6, concurrency=1),
    "concurrent16": Workload("concurrent16", num_requests=32, concurrency=16),
    "mixed": Workload("mixed", num_requests=32, concurrency=16, long_every=4),
    # ../shared/NOTES.md's peer table: 30-word chats, every 4th ~600 words, 6 at a time
    "mixed_chat": Workload("mixed_chat", num_requests=24, concurrency=6, long_every=4, short_words=30),
    # one ~1,000-token prompt at a time: TTFT is a long prompt's prefill (and hand-off) alone
    "long": Workload("long", num_requests=4, concurrency=1, max_tokens=16, long_every=1, long_words=960),
}

DEFAULT_WORKLOADS = ("single", "concurrent16", "mixed")  # what a bench runs unless told

_TOPICS = ("a lighthouse keeper", "the history of tea", "a robot learning to paint", "autumn in Kyoto",
           "how bridges carry load", "a chess match", "the water cycle", "a night market", "volcanoes",
           "a letter to a friend", "bees and flowers", "the first train", "a mountain village",
           "how compilers work", "the moon landing", "a rainy afternoon")
_WORDS = ("river stone market lantern harbor engine garden paper window copper signal forest winter "
          "letter bridge orbit candle meadow thunder ladder violin desert island mirror anchor canyon "
          "feather glacier compass velvet pepper tunnel marble saddle rocket ember willow falcon quartz").split()


def prompt_for(workload: Workload, i: int, salt: int = 0) -> str:
    """Request i's prompt: short and varied, or (every `long_every`-th) ~`long_words` words of
    notes to summarize, drawn from (salt, i): distinct per request and, with a fresh salt, per
    run, so no prefix cache can skip them (a warm-up or an earlier run sent other notes)."""
    topic = _TOPICS[i % len(_TOPICS)]
    if workload.long_every and i % workload.long_every == workload.long_every - 1:
        rng = random.Random(f"{salt}:{i}")
        notes = " ".join(rng.choice(_WORDS) for _ in range(workload.long_words))
        return f"Here are my notes about {topic}: {notes}\nSummarize them in one paragraph."
    if workload.short_words:
        rng = random.Random(f"{salt}:{i}")
        words = " ".join(rng.choice(_WORDS) for _ in range(workload.short_words))
        return f"Write a short story about {topic} with these words: {words}"
    return f"Write a short story about {topic}."


@dataclass
class Sample:
    """One request as the client saw it."""
    prompt_words: int
    sent_at: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.sent_at if self.chunk_times else None

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def run_load(load: Coroutine[Any, Any, T]) -> T:
    """Run a load to the end on uvloop, the loop Serve's own processes run. The client shares
    the cores with the server it measures, and on asyncio's default loop it spent ~1.6x the CPU
    per chunk (64 streams through the tiny model's app, 2026-11-30: 0.047 against 0.029 ms)."""
    return uvloop.run(load)


async def sse_chunks(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, dict[str, Any]]]:
    """The JSON chunks of an OpenAI SSE stream, each with the time its bytes arrived. Reads
    whatever the socket has and splits events itself (not a readline per line): the client
    shares the cores with the server it measures, so its own CPU per chunk is kept small."""
    pending = b""
    async for data in response.content.iter_any():
        now = time.perf_counter()
        *events, pending = (pending + data).split(b"\n\n")
        for event in events:
            event = event.strip()
            if event.startswith(b"data: ") and event != b"data: [DONE]":
                yield now, json.loads(event[6:])


async def stream_one(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int,
                     headers: dict[str, str]) -> Sample:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    s = Sample(prompt_words=len(prompt.split()), sent_at=time.perf_counter())
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status != 200:
                s.error = f"HTTP {r.status}: {(await r.read())[:200].decode(errors='replace')}"
                return s
            async for now, chunk in sse_chunks(r):
                if "error" in chunk:
                    s.error = f"error chunk: {chunk['error'].get('message', '')[:200]}"
                    return s
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        s.chunk_times.append(now)
                    s.finish_reason = choice.get("finish_reason") or s.finish_reason
                if chunk.get("usage"):
                    s.completion_tokens = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
    if s.error is None and (s.finish_reason is None or not s.chunk_times):
        s.error = "stream ended without text or finish_reason"
    return s


async def run_workload(url: str | list[str], model: str, workload: Workload, *, api_key: str | None = None,
                       on_done: Callable[[Sample], None] | None = None,
                       salt: int | None = None, keep_alive: bool = True) -> tuple[dict[str, Any], list[Sample]]:
    """Send the workload's requests, `concurrency` at a time; return its summary and samples.
    Long prompts are new to the server each run (a random `salt` unless one is given). Several
    URLs (one server's replicas without a balancer in front): request i goes to url[i % len].
    `keep_alive=False`: a new connection per request (llama-server closes one after a stream
    while announcing keep-alive, and a POST on the dead connection fails)."""
    urls = [url] if isinstance(url, str) else url
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    salt = random.SystemRandom().getrandbits(32) if salt is None else salt
    queue = list(range(workload.num_requests))
    samples: list[Sample] = []
    connector = aiohttp.TCPConnector(limit=workload.concurrency + 1, force_close=not keep_alive)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def worker() -> None:
            while queue:
                i = queue.pop(0)
                s = await stream_one(session, urls[i % len(urls)], model, prompt_for(workload, i, salt),
                                     workload.max_tokens, headers)
                samples.append(s)
                if on_done is not None:
                    on_done(s)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(workload.concurrency)))
        wall = time.perf_counter() - start
    return summarize(workload, samples, wall), samples


def percentile(xs: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no data."""
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def tpot_s(sample: Sample) -> float | None:
    """(last chunk − first chunk) / (completion tokens − 1); None below two tokens or chunks."""
    if sample.completion_tokens > 1 and len(sample.chunk_times) > 1:
        return (sample.chunk_times[-1] - sample.chunk_times[0]) / (sample.completion_tokens - 1)
    return None


def summarize(workload: Workload, samples: list[Sample], wall_s: float) -> dict[str, Any]:
    return {"workload": workload.name, **latency_summary(samples, wall_s, workload.concurrency, workload.max_tokens,
                                                         workload.long_words if workload.long_every else None)}


def latency_summary(samples: list[Sample], wall_s: float, concurrency: int | None = None,
                    max_tokens: int | None = None, long_words: int | None = None) -> dict[str, Any]:
    """Errors, throughput and the TTFT / ITL / TPOT percentiles of one run's samples; with
    `long_words`, the TTFT of the prompts at least that long apart too."""
    ok = [s for s in samples if s.error is None]
    ttfts = [s.ttft_s for s in ok if s.ttft_s is not None]
    itls = [gap for s in ok for gap in s.itls_s]
    tpots = [t for s in ok if (t := tpot_s(s)) is not None]
    tokens = sum(s.completion_tokens for s in ok)
    chunks = sum(len(s.chunk_times) for s in ok)
    # the long prompts alone (a mixed workload's every `long_every`-th): what short ones passing them costs
    long_ttfts = [s.ttft_s for s in ok if s.ttft_s is not None and long_words and s.prompt_words >= long_words]

    def ms(x: float | None) -> float | None:
        return None if x is None else round(x * 1000, 1)

    return {
        "requests": len(samples), "errors": len(samples) - len(ok),
        "error_kinds": sorted({s.error.split(":")[0] for s in samples if s.error}),
        **({"concurrency": concurrency} if concurrency is not None else {}),
        **({"max_tokens": max_tokens} if max_tokens is not None else {}),
        "wall_s": round(wall_s, 2), "completion_tokens": tokens,
        "out_tok_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "ttft_ms": {f"p{q}": ms(percentile(ttfts, q)) for q in (50, 90, 99)},
        "itl_ms": {"p50": ms(percentile(itls, 50)), "p99": ms(percentile(itls, 99))},
        "tpot_ms": {"p50": ms(percentile(tpots, 50))},
        "tokens_per_chunk": round(tokens / chunks, 2) if chunks else None,
        **({"ttft_long_ms": {"p50": ms(percentile(long_ttfts, 50)), "max": ms(max(long_ttfts))}} if long_ttfts else {}),
    }


def burst_profile(samples: list[Sample]) -> dict[str, Any] | None:
    """How a burst (every request sent at once) fills: when its first and last streams got
    their first token, counted from the first request sent, and the token rate over the middle
    half of its chunks (neither the streams still starting nor the last ones ending). Delivered
    tok/s over steady tok/s is what the start and the end of the load cost; None without text."""
    ok = [s for s in samples if s.error is None and s.chunk_times]
    if not ok:
        return None
    start = min(s.sent_at for s in ok)
    firsts = sorted(s.chunk_times[0] - start for s in ok)
    times = sorted(t for s in ok for t in s.chunk_times)
    per_chunk = sum(s.completion_tokens for s in ok) / len(times)
    lo, hi = times[len(times) // 4], times[(3 * len(times)) // 4]
    steady = (len(times) // 2) * per_chunk / (hi - lo) if hi > lo else None
    return {"first_token_s": {"first": round(firsts[0], 3), "p50": round(percentile(firsts, 50) or 0.0, 3),
                              "last": round(firsts[-1], 3)},
            "steady_tok_s": round(steady, 1) if steady is not None else None}
