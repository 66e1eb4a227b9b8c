"""`tandem bench`: the bench workloads against running OpenAI-compatible servers, side by side.

    tandem bench --url disaggregated=http://127.0.0.1:8000 --url colocated=http://127.0.0.1:8001
    tandem bench --replot DIR/bench.json

Unlike bench/serve.py, which starts and stops its own Ray and deploys each config in turn,
this measures servers someone else started (a Tandem app, vLLM, anything serving
/v1/chat/completions), so it can compare deployments on other machines too. For each `--url`
it sends a short unmeasured warm-up, then every named workload (cluster/loadgen.py: what TTFT,
ITL and TPOT mean there), then a concurrency sweep: the concurrent16 shape at each --concurrency
level, 2×level requests (at least 4), for throughput against concurrency. Systems run one after
another, never at once, so none slows another down.

DIR/bench.json holds, per system, each workload's summary plus its raw TTFT and ITL samples
(ms), the sweep's summaries, the URL and model, the machine that ran the client, the command
(API key masked) and timestamps; cluster/plots.py draws the PNGs from that dict alone, which is
why --replot needs no server. The exit status is 0 only if every request succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import urllib.error
import urllib.request
from dataclasses import asdict, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from cluster.loadgen import Sample, Workload

DEFAULT_OUT_DIR = "bench/results/tandem-bench"
API_KEY_ENV = "TANDEM_API_KEY"
PROBE_TIMEOUT_S = 10.0


class Unreachable(Exception):
    """A --url that does not answer GET /v1/models like an OpenAI server; the message says why."""


def add_parser(sub: Any) -> None:
    """Register `bench` on cli.py's subparsers."""
    p = sub.add_parser("bench", help="run the bench workloads against running servers; JSON + PNG plots",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", type=named_url, default=[], metavar="NAME=URL",
                   help="a system to measure, e.g. disaggregated=http://127.0.0.1:8000 (repeat for more)")
    p.add_argument("--workloads", type=workload_names, default=None,
                   help="comma-separated workloads from cluster/loadgen.py (default: all of them)")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16],
                   help="comma-separated concurrency levels for the throughput sweep (default 1,4,16; '' skips it)")
    p.add_argument("--model", default=None, help="model name to request (default: each server's first /v1/models)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"sent as 'Authorization: Bearer KEY' (default ${API_KEY_ENV})")
    p.add_argument("--out-dir", default=None, help=f"where bench.json and the PNGs go (default {DEFAULT_OUT_DIR}; "
                   "with --replot: the JSON's folder)")
    p.add_argument("--replot", default=None, metavar="BENCH_JSON", help="only redraw the PNGs from a saved bench.json")
    p.set_defaults(func=run)


def named_url(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name.strip() or not url.strip():
        raise argparse.ArgumentTypeError(f"expected NAME=URL (e.g. disaggregated=http://127.0.0.1:8000), got {text!r}")
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(f"{name}: URL must start with http:// or https://, got {url!r}")
    return name.strip(), url.removesuffix("/v1")


def workload_names(text: str) -> list[str]:
    from cluster.loadgen import WORKLOADS

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown workload(s) {', '.join(unknown) or repr(text)}; "
                                         f"known: {', '.join(WORKLOADS)}")
    return names


def int_list(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(c < 1 for c in levels):
        raise argparse.ArgumentTypeError(f"concurrency levels must be ≥ 1, got {text!r}")
    return sorted(set(levels))


def run(args: argparse.Namespace) -> int:
    from cluster.plots import plot_bench

    if args.replot:
        data = json.loads(Path(args.replot).read_text())
        for path in plot_bench(data, args.out_dir or Path(args.replot).parent):
            print(path)
        return 0
    if not args.url:
        raise ValueError("bench needs at least one --url NAME=URL (or --replot BENCH_JSON)")
    names = [name for name, _ in args.url]
    if len(set(names)) != len(names):
        raise ValueError(f"--url names must differ, got {', '.join(names)}")

    models: dict[str, str] = {}
    failed = False
    for name, url in args.url:  # all of them before any load, so a typo fails in seconds
        try:
            models[name] = probe(name, url, args.model, args.api_key)
        except Unreachable as exc:
            print(f"tandem: error: {exc}", file=sys.stderr)
            failed = True
    if failed:
        return 1

    out_dir = Path(args.out_dir or DEFAULT_OUT_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    data = run_bench(args, models, out_dir)
    print_table(data)
    for path in plot_bench(data, out_dir):
        print(path)
    return 1 if report_failures(data, out_dir) else 0


def report_failures(data: dict[str, Any], out_dir: Path) -> bool:
    """Say on stderr what went wrong, if anything; True if something did."""
    errors = sum(w["errors"] for s in data["systems"].values()
                 for w in [*s.get("workloads", {}).values(), *s.get("sweep", [])])
    problems = [f"{name}: {s['error']}" for name, s in data["systems"].items() if "error" in s]
    if errors:
        problems.append(f"{errors} measured request(s) failed (error_kinds in {out_dir / 'bench.json'})")
    if data.get("interrupted"):
        problems.append("interrupted; bench.json and the plots hold what was measured before")
    for problem in problems:
        print(f"tandem: error: {problem}", file=sys.stderr)
    return bool(problems)


def probe(name: str, url: str, model: str | None, api_key: str | None) -> str:
    """GET /v1/models: fail fast on a wrong URL or key; return `model`, else the first served one."""
    req = urllib.request.Request(f"{url}/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=PROBE_TIMEOUT_S) as r:
            body = json.load(r)
    except urllib.error.HTTPError as exc:
        hint = f"; pass --api-key (or set ${API_KEY_ENV})" if exc.code in (401, 403) else \
            "; is it an OpenAI-compatible server?"
        raise Unreachable(f"{name}={url}: GET /v1/models answered HTTP {exc.code}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Unreachable(f"{name}={url} is unreachable ({reason}); is the server running? "
                          "(`make serve` starts one on port 8000)") from None
    except ValueError:
        raise Unreachable(f"{name}={url}: GET /v1/models did not answer JSON; is it an OpenAI-compatible server?") \
            from None
    if model:
        return model
    try:
        return str(body["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise Unreachable(f"{name}={url}: GET /v1/models lists no model; pass --model") from None


def plan(args: argparse.Namespace) -> tuple[Workload, list[Workload], list[Workload]]:
    """(warm-up, measured workloads, sweep levels) for one system."""
    from cluster.loadgen import DEFAULT_WORKLOADS, WORKLOADS, Workload

    warmup = Workload("warmup", num_requests=4, concurrency=4, max_tokens=8, long_every=2)
    workloads = [WORKLOADS[n] for n in (args.workloads or DEFAULT_WORKLOADS)]
    shape = WORKLOADS["concurrent16"]
    sweep = [replace(shape, name=f"sweep-c{c}", num_requests=max(4, 2 * c), concurrency=c) for c in args.concurrency]
    return warmup, workloads, sweep


def run_bench(args: argparse.Namespace, models: dict[str, str], out_dir: Path) -> dict[str, Any]:
    """Every system in turn under one progress bar; bench.json is rewritten after each system."""
    from tqdm import tqdm

    warmup, workloads, sweep = plan(args)
    per_system = sum(w.num_requests for w in (warmup, *workloads, *sweep))
    data = header(args, workloads, sweep)
    errors = 0
    with tqdm(total=per_system * len(args.url), unit="req", dynamic_ncols=True, file=sys.stderr) as bar:
        def on_done(s: Sample) -> None:
            nonlocal errors
            errors += s.error is not None
            bar.update(1)
            if errors:
                bar.set_postfix(errors=errors)

        try:
            for name, url in args.url:
                system: dict[str, Any] = {"url": url, "model": models[name], "started": now()}
                data["systems"][name] = system
                bench_system(name, system, warmup, workloads, sweep, args.api_key, bar, on_done)
                system["finished"] = now()
                write_json(data, out_dir)
        except KeyboardInterrupt:
            data["interrupted"] = True
            bar.write("interrupted: writing what was measured so far")
    data["finished"] = now()
    write_json(data, out_dir)
    return data


def header(args: argparse.Namespace, workloads: list[Workload], sweep: list[Workload]) -> dict[str, Any]:
    """bench.json before any system has run: what was asked for, where, when."""
    return {"bench": "tandem bench", "command": command_line(args), "started": now(), "machine": machine(),
            "workloads": {w.name: asdict(w) for w in workloads},
            "sweep": {"concurrency": args.concurrency, "shape": asdict(sweep[0]) if sweep else None},
            "systems": {}}


def bench_system(name: str, system: dict[str, Any], warmup: Workload, workloads: list[Workload],
                 sweep: list[Workload], api_key: str | None, bar: Any, on_done: Callable[[Sample], None]) -> None:
    from cluster.loadgen import run_load, run_workload

    def measure(w: Workload) -> tuple[dict[str, Any], list[Sample]]:
        bar.set_description(f"{name}: {w.name}")
        return run_load(run_workload(system["url"], system["model"], w, api_key=api_key, on_done=on_done))

    summary, samples = measure(warmup)
    if summary["errors"] == summary["requests"]:
        system["error"] = f"every warm-up request failed, first: {samples[0].error}"
        bar.write(f"{name}: {system['error']}; skipped")
        bar.update(sum(w.num_requests for w in (*workloads, *sweep)))
        return
    system["workloads"], system["sweep"] = {}, []  # filled as they finish, for an interrupted run's JSON
    for w in workloads:
        system["workloads"][w.name] = record(*measure(w))
    for w in sweep:
        system["sweep"].append(measure(w)[0])


def record(summary: dict[str, Any], samples: list[Sample]) -> dict[str, Any]:
    """loadgen's summary plus the successful requests' raw TTFT and ITL values, in ms."""
    ok = [s for s in samples if s.error is None]
    return {**summary, "samples": {
        "ttft_ms": [round(s.ttft_s * 1000, 3) for s in ok if s.ttft_s is not None],
        "itl_ms": [round(gap * 1000, 3) for s in ok for gap in s.itls_s],
    }}


def command_line(args: argparse.Namespace) -> str:
    """The run as a command to repeat it, the API key masked."""
    words = ["tandem", "bench"]
    for name, url in args.url:
        words += ["--url", f"{name}={url}"]
    if args.workloads:
        words += ["--workloads", ",".join(args.workloads)]
    words += ["--concurrency", ",".join(map(str, args.concurrency))]
    if args.model:
        words += ["--model", args.model]
    if args.api_key:
        words += ["--api-key", "***"]
    if args.out_dir:
        words += ["--out-dir", str(args.out_dir)]
    return shlex.join(words)


def machine() -> dict[str, Any]:
    """The machine the client ran on (the servers may be elsewhere)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version()}


def now() -> str:
    return datetime.now().astimezone().isoformat(timespec="seconds")


def write_json(data: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / "bench.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def print_table(data: dict[str, Any]) -> None:
    def pair(d: dict[str, Any] | None) -> str:
        d = d or {}
        return f"{_num(d.get('p50'))} / {_num(d.get('p99'))}"

    print(f"{'system':<16}{'workload':<14}{'out tok/s':>10}{'TTFT p50/p99 ms':>20}{'ITL p50/p99 ms':>18}"
          f"{'TPOT ms':>9}{'errors':>8}")
    for name, system in data["systems"].items():
        if "error" in system:
            print(f"{name:<16}{system['error']}")
        for wl, s in system.get("workloads", {}).items():
            print(f"{name:<16}{wl:<14}{_num(s['out_tok_s']):>10}{pair(s['ttft_ms']):>20}{pair(s['itl_ms']):>18}"
                  f"{_num(s['tpot_ms'].get('p50')):>9}{s['errors']:>8}")
        if system.get("sweep"):
            levels = ", ".join(f"c={p['concurrency']}: {_num(p['out_tok_s'])}" for p in system["sweep"])
            print(f"{name:<16}{'sweep tok/s':<14}{levels}")


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:g}"
