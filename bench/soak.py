"""Soak: N minutes at saturation with random client hang-ups, then what is left. JSON on stdout.

    .venv/bin/python bench/soak.py [--minutes 10] [--config configs/serve.yaml] [--concurrency 16]
                                   [--args '{"max_local_prefill_tokens": 64}']

`concurrency` clients each send one streamed chat completion after another (a short prompt,
or every 4th a ~600-word one; max_tokens 16..128). A fifth of the requests hang up on purpose
after a random number of chunks (the socket is closed). Every other request must end with a
finish_reason; anything else is counted as an error by kind. At the end the bench waits for
the replicas to settle and reads each one's KV blocks in use (must be 0), running requests,
and its resident memory (from /proc, replicas being local processes) next to the figure at the
start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import aiohttp  # noqa: E402

from cluster.loadgen import WORKLOADS, prompt_for, run_load, sse_chunks  # noqa: E402
from local_cluster import deployed, local_ray, replica_stats, stdout_for_json_only  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"


def rss_mib(pid: int) -> float | None:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


async def one(session: aiohttp.ClientSession, url: str, rng: random.Random, i: int, tally: Counter) -> None:
    prompt = prompt_for(WORKLOADS["mixed"], i)
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "temperature": 0.7, "seed": i,
            "max_tokens": rng.randint(16, 128), "stream": True}
    hang_up_after = rng.randint(1, 40) if rng.random() < 0.2 else None
    chunks, finish = 0, None
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                tally[f"http_{r.status}"] += 1
                return
            async for _, chunk in sse_chunks(r):
                if "error" in chunk:
                    tally[f"error_chunk_{chunk['error'].get('code')}"] += 1
                    return
                chunks += 1
                for c in chunk.get("choices") or []:
                    finish = c.get("finish_reason") or finish
                if hang_up_after is not None and chunks >= hang_up_after:
                    r.close()  # hang up mid-stream
                    tally["hung_up_on_purpose"] += 1
                    return
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        tally[f"client_{type(exc).__name__}"] += 1
        return
    tally["completed" if finish in ("stop", "length") else "ended_without_finish_reason"] += 1


async def drive(url: str, seconds: float, concurrency: int) -> Counter:
    tally: Counter = Counter()
    stop_at = time.monotonic() + seconds
    counter = iter(range(10**9))
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency + 1)) as s:
        async def worker(w: int) -> None:
            rng = random.Random(w)
            while time.monotonic() < stop_at:
                tally["requests"] += 1
                await one(s, url, rng, next(counter), tally)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return tally


COUNTERS = ("kv_landed", "recomputed", "kv_reused_blocks", "prefilled_locally_short", "prefilled_locally_budget",
            "prefilled_locally_no_room",
            "aborted", "lease_expired", "late_acks")  # since the replica started


def snapshot(url: str) -> dict[str, dict[str, Any]]:
    return {s["replica"]: {"pool": s["pool"], "pid": s["pid"], "rss_mib": rss_mib(s["pid"]),
                           "blocks_in_use": s["blocks_in_use"], "num_running": s["num_running"],
                           "num_waiting": s["num_waiting"], **{k: s[k] for k in COUNTERS if k in s}}
            for s in replica_stats(url)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--config", default="configs/serve.yaml")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--args", type=json.loads, default={}, help="app args over the config's, as a JSON object")
    args = p.parse_args(argv)
    with stdout_for_json_only(), local_ray(args.cpus) as url, deployed(args.config, args.args):
        run_load(drive(url, 20, 4))  # warm-up, not counted
        time.sleep(6)  # the stats board's staleness window: only live replicas from here on
        start = snapshot(url)
        t0 = time.monotonic()
        tally = run_load(drive(url, args.minutes * 60, args.concurrency))
        wall = time.monotonic() - t0
        time.sleep(6)  # hang-ups and leases settle; the board catches up
        end = snapshot(url)
    replicas = {rid: {"pool": e["pool"], "rss_mib_start": start.get(rid, {}).get("rss_mib"), "rss_mib_end": e["rss_mib"],
                      "blocks_in_use_end": e["blocks_in_use"], "running_end": e["num_running"],
                      "waiting_end": e["num_waiting"], **{k: e[k] for k in COUNTERS if k in e}}
                for rid, e in end.items()}
    errors = {k: v for k, v in tally.items() if k not in ("requests", "completed", "hung_up_on_purpose")}
    result = {"bench": "soak", "config": args.config, **({"args": args.args} if args.args else {}), "minutes": round(wall / 60, 2), "concurrency": args.concurrency,
              "requests": tally["requests"], "completed": tally["completed"],
              "hung_up_on_purpose": tally["hung_up_on_purpose"], "errors": errors,
              "kv_blocks_in_use_end": sum(r["blocks_in_use_end"] for r in replicas.values()),
              "replicas_replaced": sorted(set(start) - set(end)), "replicas": replicas}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
