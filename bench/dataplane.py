"""Data-plane bench (issue 32): what the serving path keeps of the engine's token rate, and
what each process spends per token. JSON on stdout.

    PYTHONPATH=. .venv/bin/python bench/dataplane.py [--streams 64,256] [--tokens 256]
        [--systems disaggregated,colocated] [--routers 1] [--serve-env KEY=VALUE ...]
        [--repeats 3] [--skip-engine] [--out FILE] [--model PATH|default] [--num-gpus F] [--engine KEY=VALUE ...]

The model is a tiny random Llama (hidden size 16, one layer, the default model's tokenizer), so
a step costs little and the path each token takes after the engine is what is measured.

  engine    LLMEngine alone, offline, one thread, with the cluster's engine args: N streams of
            T tokens (ignore_eos) added at once; tok/s and the process's CPU s per 1k tokens
  cluster   configs/serve.yaml (disaggregated) and configs/colocated.yaml on a local Ray
            (num_cpus 2), the tiny model, max_num_seqs N; N concurrent streaming chat requests
            of T tokens from one client process on the same cores (cluster/loadgen.py: aiohttp
            on uvloop, raw SSE split): delivered tok/s, tokens per chunk, ITL p50/p99 (gap
            between chunks carrying text), and per process CPU s per 1k delivered tokens (utime
            + stime from /proc/PID/stat around the load): Serve's proxy, router, decode and
            prefill replicas, Serve's controller, the rest of Ray (raylet, GCS, stats board), the
            client; and how many cores a decode replica's process and its engine thread kept
            busy (its Python threads share one GIL and one core: the process near 1.0 is the limit).
            `burst`: when the first and the last stream got their first token, and the rate over
            the middle half of the load's chunks (cluster/loadgen.py's burst_profile); `vs_steady`
            is delivered over that rate: what taking the burst in (and the last streams ending)
            costs the load
  ratio     delivered / engine alone at the same N (issue 32's target: >= 0.8), each the median
            of --repeats runs (3): one load lasts seconds, and this machine's speed moves by more
            than that between minutes (engine alone at 64 streams: 4,185 then 4,896 tok/s in two
            runs of 2026-11-28); every run's tok/s is kept beside the median's figures
  beside    on CPU, the engine alone also runs right before each load, in this process while the
            app idles: `delivered_vs_engine_beside` is the median of those pairs' ratios, which
            the drift between minutes moves less (7,450 to 11,440 tok/s within ten minutes on
            2026-11-30)

`--serve-env` sets variables for the whole local Ray (proxy and replicas inherit them), e.g.
RAY_SERVE_THROUGHPUT_OPTIMIZED=1; `--routers` the Router deployment's replicas.

On a GPU: `--num-gpus 0.5` gives each prefill and decode replica half of one GPU (the local Ray
gets one); `--engine num_blocks=16384` sizes the KV cache by blocks, so the replicas sharing the
GPU do not each take `gpu_memory_utilization` of its free memory; `--model default` runs the
default model instead of the tiny one.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cluster.loadgen import Workload, burst_profile, prompt_for, run_load, run_workload  # noqa: E402
from local_cluster import ROOT, deployed, emit, local_ray, stdout_for_json_only  # noqa: E402
from proc_cpu import cpu_seconds, machine_busy_s, ray_processes, thread_seconds  # noqa: E402
from serve import machine, wait_http  # noqa: E402

SYSTEMS = {"disaggregated": "configs/serve.yaml", "colocated": "configs/colocated.yaml"}
TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1)
TARGET = 0.8


def log(msg: str) -> None:
    print(f"[bench/dataplane {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def tiny_model() -> Path:
    """The tiny random Llama's folder, built once under the default model's cache."""
    from cluster.models.default_model import ensure_default_model

    default = ensure_default_model(progress=False)
    target = default.parent / "tiny-llama-h16-l1"
    if not (target / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import build_tiny_model

        build_tiny_model("llama", target, default, **TINY)
    return target


def app_args(config: str, model: Path, max_seqs: int, engine: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config's app args with the model, room for every stream in one batch, and `engine` over them."""
    from cluster.serve_config import load_yaml

    args = load_yaml(ROOT / config)["applications"][0]["args"]
    return {"model": str(model), "engine": {**args.get("engine", {}), "max_num_seqs": max_seqs, **(engine or {})}}


def chat_prompts(model: Path, n: int, workload: Workload) -> list[list[int]]:
    from cluster.engine.tokenizer import Tokenizer

    tok = Tokenizer(model)
    return [tok.encode_chat([{"role": "user", "content": prompt_for(workload, i)}]) for i in range(n)]


def median_run(runs: list[dict[str, Any]], key: str = "tok_s") -> dict[str, Any]:
    """The run with the median `key` (the lower middle of an even count), every run's `key` beside it."""
    ranked = sorted(runs, key=lambda r: r[key])
    return {**ranked[(len(ranked) - 1) // 2], f"{key}_runs": [r[key] for r in runs]} if len(runs) > 1 else runs[0]


# -- the engine alone ------------------------------------------------------------------
class EngineAlone:
    """LLMEngine alone in this process, one thread, with the cluster's engine args: N streams of
    T tokens (ignore_eos, greedy) added at once, stepped until done."""

    def __init__(self, args: dict[str, Any], model: Path, tokens: int) -> None:
        import torch

        from cluster.app_config import AppConfig
        from cluster.engine.engine import LLMEngine
        from cluster.sampling_params import SamplingParams

        torch.set_num_threads(1)
        self.engine = LLMEngine(AppConfig.from_args(args).engine)
        self.params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        self.model, self.tokens = model, tokens
        self.prompts: dict[int, list[list[int]]] = {}

    def run(self, n: int) -> dict[str, Any]:
        """One run of N streams: tokens, wall, tok/s, CPU s per 1k tokens, tokens per step."""
        if n not in self.prompts:
            self.prompts[n] = chat_prompts(self.model, n, Workload(f"streams{n}", n, n, self.tokens))
            self._generate(self.prompts[n][:8])  # warm-up
        wall, cpu = time.perf_counter(), time.process_time()
        produced, steps = self._generate(self.prompts[n])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return {"tokens": produced, "wall_s": round(wall, 2), "tok_s": round(produced / wall, 1),
                "cpu_s_per_1k_tokens": round(cpu / produced * 1e3, 4), "tokens_per_step": round(produced / steps, 1)}

    def _generate(self, prompts: list[list[int]]) -> tuple[int, int]:
        for i, p in enumerate(prompts):
            self.engine.add_request(f"e{time.perf_counter_ns()}-{i}", p, self.params)
        produced = steps = 0
        while self.engine.has_unfinished_requests():
            produced += sum(len(o.outputs[0].delta_token_ids) for o in self.engine.step())
            steps += 1
        return produced, steps

    def close(self) -> None:
        """Its KV cache and CUDA graphs: the GPU's memory back to the replicas."""
        import torch

        del self.engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def engine_alone(alone: EngineAlone, streams: list[int], repeats: int = 1) -> dict[str, Any]:
    out = {}
    for n in streams:
        out[str(n)] = median_run([alone.run(n) for _ in range(repeats)])
        log(f"engine alone, {n} streams: {json.dumps(out[str(n)])}")
    return out


def direct_urls() -> list[str]:
    """The router replicas' own HTTP listeners (Serve's direct ingress: a port each, in its range)."""
    from ray.serve._private.constants import (RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT as hi,
                                              RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT as lo)

    routers = {p for p, role in ray_processes().items() if role == "router"}
    inodes = set()
    for pid in routers:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    ports = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state, inode = line.split()[1], line.split()[3], line.split()[9]
        port = int(local.split(":")[1], 16)
        if state == "0A" and inode in inodes and lo <= port < hi:  # 0A: LISTEN
            ports.append(port)
    if len(ports) != len(routers):
        raise RuntimeError(f"found {len(ports)} direct-ingress ports for {len(routers)} router replicas "
                           "(is RAY_SERVE_THROUGHPUT_OPTIMIZED=1 set via --serve-env?)")
    return [f"http://127.0.0.1:{p}" for p in sorted(ports)]


# -- the client, in a process of its own (its CPU is its own) --------------------------
def client_main(urls: list[str], model: str, streams: int, tokens: int) -> None:
    """Imports done, say "ready" and wait for "go" on stdin: the measured window holds the load alone."""
    workload = Workload(f"streams{streams}", num_requests=streams, concurrency=streams, max_tokens=tokens)
    print("ready", flush=True)
    sys.stdin.readline()
    before = resource.getrusage(resource.RUSAGE_SELF)
    summary, samples = run_load(run_workload(urls, model, workload))
    after = resource.getrusage(resource.RUSAGE_SELF)
    summary["burst"] = burst_profile(samples)
    summary["client_cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(json.dumps(summary), flush=True)


def measure_load(urls: list[str], model: str, streams: int, tokens: int, profile: Path | None = None) -> dict[str, Any]:
    """One load from a client process of its own, and what every process spent on it.
    `profile`: py-spy samples each Serve process during the load, collapsed stacks written there."""
    cmd = [sys.executable, __file__, "--client", ",".join(urls), "--model-name", model, "--streams", str(streams),
           "--tokens", str(tokens)]
    client = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert client.stdin is not None and client.stdout is not None
    if client.stdout.readline().strip() != "ready":
        raise RuntimeError(f"the client failed to start ({client.wait()})")
    pids = ray_processes()
    steps_before = decode_steps(urls[0])
    decode_pids = [p for p, role in pids.items() if role == "decode"]
    threads_before = {p: thread_seconds(p) for p in decode_pids}
    spies = [] if profile is None else [
        subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid), "-r", "50", "-f", "raw",
                          "--threads", "--nonblocking", "-o", str(profile / f"{streams}-{role}-{pid}.txt")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for pid, role in pids.items() if role in ("proxy", "router", "decode", "prefill")]
    time.sleep(1 if spies else 0)
    before, busy, wall = cpu_seconds(pids), machine_busy_s(), time.perf_counter()
    client.stdin.write("go\n")
    client.stdin.flush()
    line = client.stdout.readline()
    after, busy, wall = cpu_seconds(pids), machine_busy_s() - busy, time.perf_counter() - wall
    threads: dict[str, float] = {}
    for p in decode_pids:
        for name, sec in thread_seconds(p).items():
            threads[name] = threads.get(name, 0.0) + sec - threads_before[p].get(name, 0.0)
    for spy in spies:
        spy.send_signal(signal.SIGINT)
        spy.wait(timeout=60)
    if client.wait(timeout=60) != 0 or not line:
        raise RuntimeError(f"the client failed ({client.returncode})")
    summary = json.loads(line)
    tokens_out = summary["completion_tokens"] or 1
    # the first token of each request is the prefill's (one more step on a colocated replica)
    decoded, steps = tokens_out - summary["requests"], decode_steps(urls[0], fresh=True) - steps_before
    summary["decode_tokens_per_step"] = round(decoded / steps, 1) if steps > 0 else None
    per_role: dict[str, float] = {}
    for p, role in pids.items():
        if p in before and p in after:
            per_role[role] = per_role.get(role, 0.0) + after[p] - before[p]
    per_role["client"] = summary.pop("client_cpu_s")
    per_1k = {role: round(s / tokens_out * 1e3, 4) for role, s in sorted(per_role.items())}
    per_1k["total"] = round(sum(per_role.values()) / tokens_out * 1e3, 4)
    by_thread = {name: round(sec / tokens_out * 1e3, 4) for name, sec in sorted(threads.items(), key=lambda x: -x[1])
                 if sec > 0}
    per_replica = len(decode_pids) * wall  # a decode replica: one process, its threads on one GIL
    decode_busy = None if not decode_pids else {
        "process": round(per_role.get("decode", 0.0) / per_replica, 2),
        "engine_thread": round(threads.get("tandem-engine", 0.0) / per_replica, 2)}
    return {**summary, "cpu_s_per_1k_tokens": per_1k, "decode_threads_cpu_s_per_1k_tokens": by_thread,
            "processes": {role: sum(1 for r in pids.values() if r == role) for role in sorted(set(pids.values()))},
            "machine_busy_cores": round(busy / wall, 2), "decode_busy_cores": decode_busy}


def decode_steps(url: str, fresh: bool = False) -> int:
    """Engine steps so far, summed over the decode replicas, from /debug/stats; `fresh`: once each
    has posted after this call (replicas post every 0.5 s)."""
    import urllib.request

    since, deadline = time.time(), time.monotonic() + 5
    while True:
        with urllib.request.urlopen(f"{url}/debug/stats", timeout=10) as r:
            decode = [s for s in json.load(r)["replicas"] if s.get("pool") == "decode"]
        if not fresh or all(s.get("posted_at", 0) > since for s in decode) or time.monotonic() > deadline:
            return sum(s.get("steps", 0) for s in decode)
        time.sleep(0.1)


def stream_paths(url: str) -> dict[str, float]:
    """The routers' tandem:token_streams counters so far (multiplexed / own), from /metrics."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for path, value in re.findall(r'^tandem:token_streams_total\{[^}]*path="(\w+)"[^}]*\} (\S+)$', text, re.M):
        found[path] = found.get(path, 0.0) + float(value)
    return found


def cluster(system: str, args: dict[str, Any], model: Path, streams: list[int], tokens: int,
            routers: int, url: str, profile: Path | None, direct: bool, num_gpus: float = 0.0,
            repeats: int = 1, alone: EngineAlone | None = None) -> dict[str, Any]:
    """The system's loads, each run right after a run of the engine alone (`alone`) when given."""
    from cluster.serve_config import load_yaml

    config = SYSTEMS[system]
    n = max(streams)
    # each router replica's token channel is one more ongoing call on a decode replica: without
    # room for it, the last stream is turned away and Serve retries it seconds later
    pools = {"Router": {"num_replicas": routers}, "DecodePool": {"max_ongoing_requests": n + routers},
             "PrefillPool": {"max_ongoing_requests": n}}
    if num_gpus:  # the config's ray_actor_options (num_cpus) with a share of the GPU
        for d in load_yaml(ROOT / config)["applications"][0]["deployments"]:
            if d["name"] in ("PrefillPool", "DecodePool"):
                pools[d["name"]]["ray_actor_options"] = {**d.get("ray_actor_options", {}), "num_gpus": num_gpus}
    log(f"{system}: deploying {config} with {model.name}, {routers} router replica(s), num_gpus {num_gpus}")
    out: dict[str, Any] = {"config": config, "routers": routers}
    with deployed(config, args, pools):
        wait_http(f"{url}/health", 120)
        warm = Workload("warmup", num_requests=8, concurrency=8, max_tokens=16)
        summary, _ = run_load(run_workload(url, model.name, warm))
        if summary["errors"]:
            raise RuntimeError(f"warm-up failed: {summary}")
        urls = direct_urls() if direct else [url]
        out["urls"] = urls
        for s in streams:
            spy_dir = None
            if profile is not None:
                (spy_dir := profile / system).mkdir(parents=True, exist_ok=True)
            runs = []
            for _ in range(repeats):
                beside = alone.run(s) if alone is not None else None  # this minute's engine alone
                runs.append(measure_load(urls, model.name, s, tokens, spy_dir))
                steady = (runs[-1]["burst"] or {}).get("steady_tok_s")
                runs[-1]["vs_steady"] = round(runs[-1]["out_tok_s"] / steady, 3) if steady else None
                if beside is not None:
                    runs[-1]["engine_alone_beside_tok_s"] = beside["tok_s"]
                    runs[-1]["vs_engine_beside"] = round(runs[-1]["out_tok_s"] / beside["tok_s"], 3)
            out[str(s)] = median_run(runs, "out_tok_s")
            if alone is not None:
                pairs = [r["vs_engine_beside"] for r in runs]
                out[str(s)]["vs_engine_beside_runs"] = pairs
                out[str(s)]["vs_engine_beside_median"] = sorted(pairs)[(len(pairs) - 1) // 2]
            out[str(s)]["token_streams"] = stream_paths(url)
            log(f"{system}, {s} streams: {json.dumps(out[str(s)])}")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="64,256", help="comma-separated concurrent streams (default 64,256)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per stream (default 256)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: " + ", ".join(SYSTEMS))
    p.add_argument("--routers", type=int, default=1, help="Router replicas (default 1)")
    p.add_argument("--serve-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for the local Ray and every process it starts")
    p.add_argument("--direct", action="store_true",
                   help="the client talks to each router replica's own HTTP port (Serve's direct ingress, "
                        "on under RAY_SERVE_THROUGHPUT_OPTIMIZED=1), not through Serve's proxy")
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each load, engine alone and through each system; the median's figures are "
                        "reported, every run's tok/s beside them (default 3)")
    p.add_argument("--skip-engine", action="store_true", help="no engine-alone run (no ratios)")
    p.add_argument("--model", help="a local HF folder, or 'default' for the default model (default: the tiny model)")
    p.add_argument("--num-gpus", type=float, default=0.0,
                   help="GPUs per prefill and decode replica, e.g. 0.5 (default 0: CPU); the local Ray gets "
                        "one GPU when this is set")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                   help="an engine arg over the configs' (value read as JSON, else a string), e.g. num_blocks=16384")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--profile", help="py-spy each Serve process during every load (its CPU figures then "
                                      "include py-spy's cost); collapsed stacks under this folder")
    p.add_argument("--client", help=argparse.SUPPRESS)  # internal: run the load against this URL
    p.add_argument("--model-name", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    if args.client:
        client_main(args.client.split(","), args.model_name, streams[0], args.tokens)
        return None
    serve_env = dict(kv.split("=", 1) for kv in args.serve_env)
    os.environ.update(serve_env)
    engine_over = {k: _value(v) for k, v in (kv.split("=", 1) for kv in args.engine)}
    if args.model is None:
        model, model_info = tiny_model(), TINY
    else:
        from cluster.models.default_model import ensure_default_model

        model = ensure_default_model(progress=False) if args.model == "default" else Path(args.model).resolve()
        model_info = {}
    base = app_args(SYSTEMS["disaggregated"], model, max(streams), engine_over)
    result: dict[str, Any] = {
        "bench": "dataplane", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "model": {"path": str(model), **model_info},
        "tokens_per_stream": args.tokens, "repeats": args.repeats, "engine_args": base["engine"], "serve_env": serve_env}
    if args.num_gpus:
        import torch

        result["machine"]["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        result["num_gpus_per_replica"] = args.num_gpus
    with stdout_for_json_only():
        alone = None if args.skip_engine else EngineAlone(base, model, args.tokens)
        if alone is not None:
            result["engine_alone"] = engine_alone(alone, streams, args.repeats)
            if args.num_gpus:  # not beside the replicas: they need the GPU's memory
                alone.close()
                alone = None
        systems: dict[str, Any] = {}
        with local_ray(os.cpu_count() or 2, num_gpus=1 if args.num_gpus else None) as url:
            for system in args.systems.split(","):
                systems[system] = cluster(system, app_args(SYSTEMS[system], model, max(streams), engine_over), model,
                                          streams, args.tokens, args.routers, url,
                                          Path(args.profile) if args.profile else None, args.direct, args.num_gpus,
                                          args.repeats, alone)
    result["systems"] = systems
    if "engine_alone" in result:
        result["delivered_vs_engine"] = {
            system: {s: round(r[s]["out_tok_s"] / result["engine_alone"][s]["tok_s"], 3) for s in map(str, streams)}
            for system, r in systems.items()}
        if not args.num_gpus:
            result["delivered_vs_engine_beside"] = {
                system: {s: r[s]["vs_engine_beside_median"] for s in map(str, streams)} for system, r in systems.items()}
        result["target"] = TARGET
    return emit(result, args.out)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


if __name__ == "__main__":
    main()
