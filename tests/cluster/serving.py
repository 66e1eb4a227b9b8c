"""Helpers for the cluster tests: deploy Tandem on the session's local Ray, talk to it over
HTTP (the `openai` SDK, /debug/stats), and read Serve's own view of the pools."""

from __future__ import annotations

import collections
import http.client
import json
import socket
import threading
import time
import urllib.request
from typing import Any, Callable

import yaml

APP = "tandem"
SERVE_PORTS: dict[str, int] = {}  # the ports of the Serve now running ({} while none runs; conftest.py)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_config(config_file: str) -> dict[str, Any]:
    return yaml.safe_load(open(f"configs/{config_file}"))


def args_of(config_file: str) -> dict[str, Any]:
    """A config's app args, placement by SLO off: the tests that deploy them check the hand-off,
    so every prompt crosses the connector (test_identical_replies deploys serve.yaml as shipped)."""
    args = shipped_args(config_file)
    return {**args, "ttft_slo_ms": 0, "itl_slo_ms": 0} if "ttft_slo_ms" in args or "itl_slo_ms" in args else args


def hand_off_config(config_file: str) -> dict[str, Any]:
    """The whole Serve config, its app args as `args_of` gives them (placement by SLO off)."""
    config = load_config(config_file)
    config["applications"][0]["args"] = args_of(config_file)
    return config


def in_float32(args: dict[str, Any]) -> dict[str, Any]:
    """App args whose engines compute in float32 whatever the CPU (`auto` is bf16 where it is
    native): for tests that ask different paths for the very same tokens."""
    return {**args, "engine": {**args.get("engine", {}), "dtype": "float32"}}


def small_kv(args: dict[str, Any], nbytes: int = 128 << 20) -> dict[str, Any]:
    """App args whose replicas each hold `nbytes` of KV cache. A replica zero-fills and
    prefaults its cache as it starts: the shipped configs' 1 GiB cost test_identical_replies'
    five deploys ~30 s on two cores (112 s against 82 s for the test, 2026-11-30), and a test's
    few prompts fit in 128 MiB many times over."""
    return {**args, "engine": {**args.get("engine", {}), "cpu_kv_cache_bytes": nbytes}}


def shipped_args(config_file: str) -> dict[str, Any]:
    return load_config(config_file)["applications"][0]["args"]


def deploy(args: dict[str, Any], faults: bool = False) -> None:
    """(Re)deploy the Tandem app with these args through serve.run; returns when it is healthy.
    An app deployed before is deleted first: replaced in place, its old router could still answer
    while the proxy learns of the new one. `faults`: pools a test can arm faults in
    (tests/fault_pools.py)."""
    from ray import serve

    if faults:
        from fault_pools import build_app
    else:
        from cluster.router.app import build_app

    serve.delete(APP)
    serve.run(build_app(args), name=APP, route_prefix="/")
    wait_routed()


def wait_routed(timeout_s: float = 60.0) -> None:
    """Until the HTTP proxy routes to the app: Serve reports an app healthy before its proxy has
    learned the new route (on a loaded host, seconds later), and a request sent in between is a
    404. /health answers without the API key."""
    if not SERVE_PORTS:
        return
    url = f"http://127.0.0.1:{SERVE_PORTS['http']}"
    deadline = time.monotonic() + timeout_s
    while (status := http_request(url, "GET", "/health")[0]) != 200:
        assert time.monotonic() < deadline, f"the proxy never routed /health to the app (last {status})"
        time.sleep(0.05)


def apply_config(config: dict[str, Any]) -> None:
    """What `serve deploy FILE` does (see cluster.serve_config.apply_serve_config)."""
    from cluster.serve_config import apply_serve_config

    apply_serve_config(config)


def fresh(cfg: dict[str, Any], want: dict[str, int], timeout_s: float = 240, settled: bool = True) -> None:
    """The app deleted, then deployed from `cfg` as `serve deploy` would (config-managed, not
    serve.run's); returns once Serve runs `want` replicas per deployment."""
    from ray import serve

    serve.delete(APP)
    apply_config(cfg)
    wait_for(lambda: running_replicas(settled) == want, timeout_s, f"replicas {want}")
    if settled:
        wait_routed()


def running_replicas(settled: bool = True) -> dict[str, int]:
    """Serve's view: RUNNING replicas per deployment of the app (with `settled`, empty while
    the app itself is not RUNNING)."""
    from ray import serve

    app = serve.status().applications.get(APP)
    if app is None or (settled and str(app.status).split(".")[-1] != "RUNNING"):
        return {}
    return {name: d.replica_states.get("RUNNING", 0) for name, d in app.deployments.items()}


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.5)


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def fetch_stats(url: str, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """/debug/stats once: what each pool replica last posted to the stats board."""
    with urllib.request.urlopen(urllib.request.Request(f"{url}/debug/stats", headers=headers or {}),
                                timeout=10) as r:
        return json.load(r)["replicas"]


POOL_DEPLOYMENTS = {"prefill": "PrefillPool", "decode": "DecodePool"}


def replica_stats(url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """Every pool replica's counters as posted after this call began, once there are as many
    as Serve runs: replicas post every 0.5 s (stats_board.PERIOD_S), so this waits about that
    long; one that is gone stops posting and leaves the board after its staleness window
    (STALE_S, 5 s); one just started posts once Serve has checked its health. Past
    `timeout_s`, the last read."""
    since = time.time()
    deadline = time.monotonic() + timeout_s
    while True:
        stats = fetch_stats(url, headers)
        running = running_replicas(settled=False)
        posted = collections.Counter(s["pool"] for s in stats)
        if ((all(s.get("posted_at", 0) > since for s in stats)
             and all(posted[pool] == running[name] for pool, name in POOL_DEPLOYMENTS.items() if name in running))
                or time.monotonic() > deadline):
            return stats
        time.sleep(0.1)


def http_request(url: str, method: str, path: str, body: bytes | None = None,
            headers: dict[str, str] | list[tuple[str, str]] | None = None) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP exchange (any bytes, any headers): (status, lower-cased headers, body)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.putrequest(method, path)
        items = headers.items() if isinstance(headers, dict) else (headers or [])
        names = {k.lower() for k, _ in items}
        for k, v in items:
            conn.putheader(k, v)
        if "content-type" not in names and body is not None:
            conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(body or b"")))
        conn.endheaders(body)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def wait_for_replica(url: str, predicate: Callable[[dict[str, Any]], bool], timeout_s: float,
                     what: str) -> dict[str, Any]:
    """The first replica whose posted stats satisfy `predicate` (the board polled every 0.1 s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = next((s for s in fetch_stats(url) if predicate(s)), None)
        if found is not None:
            return found
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def pool_stats(url: str, pools: tuple[str, ...], timeout_s: float = 30.0) -> dict[str, dict[str, Any]]:
    """Per pool of `pools`, the stats its replica posted most recently, once each has posted
    since this call began (a just-deployed app answers before its replicas' first posts; a
    replica gone lingers on the board for STALE_S, and is never the one returned)."""
    since = time.time()
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {s["pool"]: s for s in sorted(fetch_stats(url), key=lambda s: s.get("posted_at", 0))}
        if all(p in stats and stats[p].get("posted_at", 0) > since for p in pools):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {pools} to post stats")
        time.sleep(0.1)


def chat_in_background(url: str, content: str, max_tokens: int,
                       model: str = "SmolLM2-135M-Instruct") -> tuple[threading.Thread, dict[str, Any]]:
    """A greedy chat completion on its own thread; the dict gets finish/tokens, or error."""
    result: dict[str, Any] = {}

    def ask() -> None:
        try:
            r = client(url).chat.completions.create(model=model, temperature=0,
                                                    max_tokens=max_tokens,
                                                    messages=[{"role": "user", "content": content}])
            result["finish"], result["tokens"] = r.choices[0].finish_reason, r.usage.completion_tokens
        except Exception as exc:
            result["error"] = repr(exc)

    thread = threading.Thread(target=ask)
    thread.start()
    return thread, result


def open_stream(url: str, content: str, max_tokens: int, stream: bool = True,
                headers: dict[str, str] | None = None, model: str = "SmolLM2-135M-Instruct") -> http.client.HTTPConnection:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream})
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json", **(headers or {})})
    return conn


def hang_up(conn: http.client.HTTPConnection) -> float:
    conn.sock.close()
    conn.close()
    return time.time()


def settled(url: str, aborted_after: float | None = None, pools: tuple[str, ...] = (),
            timeout_s: float = 20.0, headers: dict[str, str] | None = None) -> dict[str, dict]:
    """Poll until nothing is in use anywhere (and `pools` have recorded an abort after
    `aborted_after`); return the last stats per pool."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {s["pool"]: s for s in replica_stats(url, headers=headers)}
        idle = all(s["blocks_in_use"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0
                   and s.get("num_remote", 0) == 0 and s.get("leases", 0) == 0 for s in stats.values())
        recorded = all(p in stats and stats[p]["last_abort_at"] > (aborted_after or 0) for p in pools)
        if (idle and recorded) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


STEADY_PROMPTS = ["Name a fruit.", "What is 2 + 2?", "Say hello in French.", "Name a planet.", "What color is the sky?"]


class SteadyStream:
    """`workers` clients, each sending one streamed chat completion after another until stopped;
    every outcome is kept: (finish time, finish_reason or the exception's text, content)."""

    def __init__(self, url: str, model: str, workers: int = 2) -> None:
        self.client, self.model = client(url), model
        self.outcomes: list[tuple[float, str, str]] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(workers)]

    def __enter__(self) -> "SteadyStream":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def completed_since(self, t0: float) -> int:
        return sum(1 for t, finish, _ in list(self.outcomes) if t >= t0 and finish in ("stop", "length"))

    def _loop(self, worker: int) -> None:
        i = worker
        while not self._stop.is_set():
            # Each prompt new to every prefix cache past the system prompt (~60 tokens of tags):
            # where it goes is decided by load, not by which replica has computed it before.
            tags = " ".join(str(i * 7919 + j) for j in range(12))
            prompt = f"Request {i}, tags {tags}. {STEADY_PROMPTS[i % len(STEADY_PROMPTS)]}"
            i += len(self._threads)
            try:
                parts, finish = [], None
                for chunk in self.client.chat.completions.create(
                        model=self.model, messages=[{"role": "user", "content": prompt}], temperature=0,
                        max_tokens=12, stream=True):
                    if chunk.choices:
                        parts.append(chunk.choices[0].delta.content or "")
                        finish = chunk.choices[0].finish_reason or finish
                outcome = (time.monotonic(), str(finish), "".join(parts))
            except Exception as exc:  # a failed request: what every test using this must not see
                outcome = (time.monotonic(), f"{type(exc).__name__}: {exc}", "")
            self.outcomes.append(outcome)
            if outcome[1] not in ("stop", "length") or not outcome[2]:
                self.failures.append(f"{prompt!r}: {outcome[1]} {outcome[2]!r}")


def scrape(url: str) -> dict[tuple, float]:
    """/metrics parsed by prometheus_client: (sample name, sorted labels) → value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples: dict[tuple, float], name: str, **match: str) -> float:
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == want for k, want in match.items()))
