"""`tandem bench` offline: the plots it draws from bench.json (and redraws with --replot), the
raw samples it stores, its argument errors, and a fast, named failure on an unreachable URL.
The run against real servers is a manual step (README); nothing here stands in for a server."""

from __future__ import annotations

import json
import math
import random
import socket
import struct
import time

import matplotlib.image
import pytest

from cluster.bench_cli import header, named_url, plan, record, write_json
from cluster.cli import build_parser, main
from cluster.loadgen import Sample, percentile, summarize
from cluster.plots import DPI, PLOTS, plot_bench

SYSTEMS = {"disaggregated": (300.0, 20.0), "colocated": (150.0, 35.0)}  # name → (TTFT, ITL) medians, ms


def fake_samples(rng: random.Random, n: int, ttft_ms: float, itl_ms: float, tokens: int = 16) -> list[Sample]:
    """What loadgen.stream_one records, with made-up times (lognormal around the medians)."""
    samples = []
    for _ in range(n):
        s = Sample(prompt_words=6, sent_at=100.0, completion_tokens=tokens, finish_reason="length")
        t = s.sent_at + rng.lognormvariate(math.log(ttft_ms / 1000), 0.4)
        for _ in range(tokens):
            s.chunk_times.append(t)
            t += rng.lognormvariate(math.log(itl_ms / 1000), 0.6)
        samples.append(s)
    return samples


def make_bench(*argv: str, failed_system: str | None = None) -> dict:
    """A bench.json dict built by bench_cli's own pieces, with loadgen's summaries over made-up samples."""
    args = build_parser().parse_args(["bench", *argv, *(f"--url={n}=http://127.0.0.1:1" for n in SYSTEMS)])
    _, workloads, sweep = plan(args)
    data = header(args, workloads, sweep)
    rng = random.Random(0)
    for name, (ttft, itl) in SYSTEMS.items():
        system: dict = {"url": "http://127.0.0.1:1", "model": "SmolLM2-135M-Instruct"}
        if name == failed_system:
            system["error"] = "every warm-up request failed, first: HTTP 404"
        else:
            system["workloads"] = {w.name: record(summarize(w, s := fake_samples(rng, w.num_requests, ttft, itl),
                                                            wall_s=1.0 + len(s) / w.concurrency), s)
                                   for w in workloads}
            system["sweep"] = [summarize(w, fake_samples(rng, w.num_requests, ttft, itl), wall_s=2.0) for w in sweep]
        data["systems"][name] = system
    return json.loads(json.dumps(data))  # what a reader of bench.json gets


def png_size(path) -> tuple[int, int]:
    blob = path.read_bytes()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n" and blob[12:16] == b"IHDR"
    return struct.unpack(">II", blob[16:24])


def test_plots_are_pngs_of_the_promised_shape(tmp_path):
    data = make_bench()
    paths = plot_bench(data, tmp_path)
    assert sorted(p.name for p in paths) == sorted(PLOTS)
    n_workloads = len(data["workloads"])
    assert n_workloads == 3
    assert png_size(tmp_path / "summary.png") == (13 * DPI, round(9.5 * DPI))
    assert png_size(tmp_path / "ttft.png") == (round(5.2 * n_workloads * DPI), round(4.2 * DPI))
    assert png_size(tmp_path / "itl.png") == png_size(tmp_path / "ttft.png")
    for p in paths:
        assert p.stat().st_size > 20_000, p  # drawn lines and text, not an empty canvas
        pixels = matplotlib.image.imread(p)
        assert pixels[..., :3].std() > 0.05, p


def test_replot_redraws_the_same_pngs_from_the_saved_json(tmp_path, capsys):
    data = make_bench()
    first = {p.name: p.read_bytes() for p in plot_bench(data, tmp_path / "first")}
    (tmp_path / "run").mkdir()
    saved = write_json(data, tmp_path / "run")
    assert main(["bench", "--replot", str(saved)]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(tmp_path / "run" / n) for n in PLOTS)
    assert {n: (tmp_path / "run" / n).read_bytes() for n in PLOTS} == first


def test_a_system_that_failed_is_plotted_without_it(tmp_path):
    paths = plot_bench(make_bench(failed_system="colocated"), tmp_path)
    assert all(png_size(p)[0] > 0 for p in paths)


def test_raw_samples_agree_with_the_summary():
    data = make_bench("--workloads", "mixed", "--concurrency", "2,8")
    for system in data["systems"].values():
        mixed = system["workloads"]["mixed"]
        assert len(mixed["samples"]["ttft_ms"]) == mixed["requests"] == 32
        assert len(mixed["samples"]["itl_ms"]) == 32 * 15  # 16 chunks each → 15 gaps
        for metric in ("ttft_ms", "itl_ms"):
            for q in (50, 99):
                assert percentile(mixed["samples"][metric], q) == pytest.approx(mixed[metric][f"p{q}"], abs=0.06)
        assert [p["concurrency"] for p in system["sweep"]] == [2, 8]
        assert [p["requests"] for p in system["sweep"]] == [4, 16]


def test_the_recorded_command_repeats_the_run_without_the_api_key():
    data = make_bench("--api-key", "sekrit-123", "--workloads", "single", "--model", "m")
    assert "sekrit" not in json.dumps(data)
    assert data["command"].startswith("tandem bench --url disaggregated=http://127.0.0.1:1")
    assert "--api-key '***'" in data["command"] and "--workloads single" in data["command"]
    assert data["machine"]["cores"] >= 1 and data["machine"]["platform"]


@pytest.mark.parametrize("argv,named", [
    (["--url", "http://127.0.0.1:8000"], ["argument --url", "NAME=URL"]),
    (["--url", "a=127.0.0.1:8000"], ["argument --url", "http://"]),
    (["--url", "a=http://h:1", "--workloads", "single,bursty"], ["argument --workloads", "bursty",
                                                                  "single, concurrent16, mixed"]),
    (["--url", "a=http://h:1", "--concurrency", "4,0"], ["argument --concurrency"]),
])
def test_bad_arguments_are_refused_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(text in err for text in named), err


def test_a_url_given_with_v1_or_a_slash_is_the_same_server():
    assert named_url("d=http://h:8000/v1/") == named_url("d=http://h:8000") == ("d", "http://h:8000")


def test_no_url_is_an_error_not_a_traceback(capsys):
    assert main(["bench"]) == 2
    assert "--url NAME=URL" in capsys.readouterr().err


def test_an_unreachable_url_fails_fast_naming_it(tmp_path, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    rc = main(["bench", "--url", f"colocated=http://127.0.0.1:{port}", "--out-dir", str(tmp_path / "out")])
    assert rc == 1
    assert time.monotonic() - start < 5
    err = capsys.readouterr().err
    assert f"colocated=http://127.0.0.1:{port}" in err and "unreachable" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing measured, nothing written


def test_long_prompts_are_new_to_the_server_on_every_run():
    """A prefix cache must not skip the mixed workload's long prompts: not within a run, not after
    a warm-up or an earlier run (the client records what a minimal SSE server received), on the
    loop the benches run their loads on."""
    from aiohttp import web

    from cluster.loadgen import Workload, run_load, run_workload

    async def two_runs() -> list[list[str]]:
        seen: list[str] = []

        async def chat(request: web.Request) -> web.StreamResponse:
            seen.append((await request.json())["messages"][0]["content"])
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            chunk = {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "length"}],
                     "usage": {"completion_tokens": 1}}
            await resp.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
            return resp

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        runs = []
        try:
            for _ in range(2):
                seen.clear()
                w = Workload("mixed", num_requests=8, concurrency=2, long_every=4)
                summary, _ = await run_workload(f"http://127.0.0.1:{port}", "m", w)
                assert summary["errors"] == 0, summary
                runs.append(sorted(seen))
        finally:
            await runner.cleanup()
        return runs

    first, second = run_load(two_runs())
    long_first = [p for p in first if len(p.split()) > 500]
    long_second = [p for p in second if len(p.split()) > 500]
    assert len(long_first) == len(long_second) == 2
    assert len(set(long_first)) == 2 and not set(long_first) & set(long_second)
    assert [p for p in first if p not in long_first] == [p for p in second if p not in long_second]


def test_a_burst_profile_reads_the_start_and_the_steady_rate_off_the_chunks():
    """Four streams sent at t=10: the first gets its first token at 0.3 s, the last at 0.9 s;
    then each carries a 2-token chunk every 10 ms for 4 s: 800 tok/s in the middle of the load,
    all four sending, whatever the slow start (which the delivered rate pays for)."""
    from cluster.loadgen import Workload, burst_profile

    samples = []
    for i, first in enumerate((0.3, 0.5, 0.7, 0.9)):
        times = [10 + first + 0.01 * k for k in range(400)]
        samples.append(Sample(prompt_words=3, sent_at=10 + 0.001 * i, chunk_times=times, completion_tokens=800,
                              finish_reason="length"))
    samples.append(Sample(prompt_words=3, sent_at=9.0, error="HTTP 500: boom"))  # not part of the burst's fill
    profile = burst_profile(samples)
    assert profile["first_token_s"] == {"first": 0.3, "p50": 0.5, "last": 0.9}
    # the middle half of the chunks falls where every stream sends: 4 streams x 2 tokens / 10 ms
    assert profile["steady_tok_s"] == pytest.approx(800, rel=0.05)
    delivered = summarize(Workload("b", 4, 4, 800), samples[:4], wall_s=0.9 + 3.99)["out_tok_s"]
    assert delivered < 0.85 * profile["steady_tok_s"]
    assert burst_profile([Sample(prompt_words=3, error="timeout")]) is None
