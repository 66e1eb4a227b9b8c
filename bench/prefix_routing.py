"""Prefix-aware routing bench: multi-turn conversations over two prefill replicas, routed by
what each replica's prefix cache holds and by load alone, in the same run; JSON on stdout.

    .venv/bin/python bench/prefix_routing.py [--conversations 6] [--turns 4] [--out FILE]

configs/serve.yaml with 2 prefill replicas (and each pool replica at 0.5 CPU, so that three fit
on a 2-core machine's Ray), deployed once with `prefix_aware_routing: true` and once with
`false`. Each conversation runs its turns one after another (the reply goes into the history,
and the next user message, ~120 words of notes, is new), the conversations at once. Per turn
from the second on, from the client: TTFT (send → first chunk with text) and the usage's
`prompt_tokens_details.cached_tokens`: how much of the history a prefix cache served; and from
the request's trace (/debug/requests/ID), the KV bytes the prefill replica sent and the prompt
tokens whose KV the decode replica already held (decode-side prefix reuse: not sent). Every
run draws fresh notes, so no earlier run's cache helps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster.loadgen import percentile, run_load, sse_chunks  # noqa: E402
from local_cluster import deployed, emit, local_ray, stdout_for_json_only  # noqa: E402
from serve import MODEL_NAME, log, machine, wait_http  # noqa: E402

WORDS = ("crate dock ledger barrel harbor invoice pallet crane signal copper ferry anchor freight "
         "lantern manifest tide rope cargo mooring quay").split()
POOLS = {"PrefillPool": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}},
         "DecodePool": {"ray_actor_options": {"num_cpus": 0.5}}}


async def turn(session: aiohttp.ClientSession, url: str, messages: list[dict], max_tokens: int,
               rid: str) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent, first, text, usage = time.perf_counter(), None, [], {}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": rid}) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:200]!r}")
        async for now, chunk in sse_chunks(r):
            if "error" in chunk:
                raise RuntimeError(f"error chunk: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or now
                    text.append(piece)
            usage = chunk.get("usage") or usage
    for _ in range(50):  # the trace is posted by the router as the stream ends
        async with session.get(f"{url}/debug/requests/{rid}") as r:
            if r.status == 200:
                (trace,) = (await r.json())["traces"]
                break
        await asyncio.sleep(0.1)
    else:
        raise RuntimeError(f"no trace of {rid}")
    return {"ttft_s": (first or time.perf_counter()) - sent, "reply": "".join(text),
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "kv_bytes": trace.get("kv_bytes", 0), "kv_reused_tokens": trace.get("kv_reused_tokens", 0)}


async def conversations(url: str, n: int, turns: int, max_tokens: int) -> list[list[dict[str, Any]]]:
    seed = random.SystemRandom().getrandbits(32)
    rng = random.Random(seed)

    async def one(k: int, session: aiohttp.ClientSession) -> list[dict[str, Any]]:
        messages, out = [], []
        for t in range(turns):
            notes = " ".join(f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(120))
            messages.append({"role": "user", "content": f"Conversation {k}, part {t + 1} of my notes: {notes}"})
            result = await turn(session, url, messages, max_tokens, f"bench-{seed:x}-{k}-{t}")
            messages.append({"role": "assistant", "content": result["reply"]})
            out.append(result)
        return out

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        return await asyncio.gather(*(one(k, session) for k in range(n)))


def summarize(runs: list[list[dict[str, Any]]], wall_s: float) -> dict[str, Any]:
    later = [r for conv in runs for r in conv[1:]]  # turns with a history to reuse
    ttft = [r["ttft_s"] * 1000 for r in later]
    prompt, cached = sum(r["prompt_tokens"] for r in later), sum(r["cached_tokens"] for r in later)
    return {"turns_measured": len(later), "wall_s": round(wall_s, 1),
            "ttft_ms": {f"p{q}": round(percentile(ttft, q), 1) for q in (50, 90, 99)},
            "prompt_tokens": prompt, "cached_tokens": cached, "cached_fraction": round(cached / prompt, 3),
            "kv_mb_sent": round(sum(r["kv_bytes"] for r in later) / 1e6, 1),
            "kv_reused_fraction": round(sum(r["kv_reused_tokens"] for r in later) / prompt, 3)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    systems: dict[str, Any] = {}
    with stdout_for_json_only(), local_ray(os.cpu_count() or 2) as url:
        for name, aware in (("prefix_aware", True), ("load_only", False)):
            log(f"{name}: deploying configs/serve.yaml, 2 prefill replicas, prefix_aware_routing={aware}")
            with deployed("configs/serve.yaml", {"prefix_aware_routing": aware}, POOLS):
                wait_http(f"{url}/health", 120)
                run_load(conversations(url, 2, 1, 4))  # warm-up, not measured
                start = time.perf_counter()
                runs = run_load(conversations(url, args.conversations, args.turns, args.max_tokens))
                systems[name] = summarize(runs, time.perf_counter() - start)
                log(f"  {json.dumps(systems[name])}")
    a, b = systems["prefix_aware"], systems["load_only"]
    result = {"bench": "prefix_routing", "machine": machine(), "model": MODEL_NAME,
              "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "conversations": args.conversations, "turns": args.turns, "systems": systems,
              "ttft_p50_aware_vs_load_only": round(a["ttft_ms"]["p50"] / b["ttft_ms"]["p50"], 3),
              "ttft_p90_aware_vs_load_only": round(a["ttft_ms"]["p90"] / b["ttft_ms"]["p90"], 3)}
    return emit(result, args.out)


if __name__ == "__main__":
    main()
