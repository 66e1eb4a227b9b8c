"""A Tandem app on a local Ray for the benches: start Ray and Serve, deploy a configs/ file the
way `serve deploy` does, wait until it runs, tear everything down after."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_running(app_name: str, timeout_s: float) -> None:
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        app = serve.status().applications.get(app_name)
        status = str(getattr(app, "status", "")).split(".")[-1]
        if status == "RUNNING":
            return
        if status == "DEPLOY_FAILED":
            raise RuntimeError(f"{app_name} failed to deploy: {app.message}")
        time.sleep(1)
    raise TimeoutError(f"{app_name} not RUNNING after {timeout_s:.0f} s")


@contextlib.contextmanager
def stdout_for_json_only() -> Iterator[None]:
    """Inside: whatever reaches this process's stdout (Ray's own lines, such as a '(raylet) ...
    graceful_shutdown failed' at teardown) goes to stderr, so stdout carries the JSON alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


@contextlib.contextmanager
def local_ray(cpus: int, num_gpus: int | None = None) -> Iterator[str]:
    """Ray (num_cpus=cpus; num_gpus, or Ray's own count when None) and Serve on a free loopback
    port; yields the HTTP base URL."""
    import ray
    from ray import serve

    ray.init(num_cpus=cpus, num_gpus=num_gpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextlib.contextmanager
def deployed(config_path: str, overrides: dict[str, Any] | None = None,
             pools: dict[str, dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
    """Deploy one configs/ file (its app's `args` updated by `overrides`, each deployment named
    in `pools` by its entry there); yields its app entry."""
    from ray import serve

    from cluster.serve_config import apply_serve_config, load_yaml

    config = load_yaml(ROOT / config_path)
    app = config["applications"][0]
    for key, value in (overrides or {}).items():  # a dict (engine, kv_transfer) is updated, not replaced
        base = app["args"].get(key)
        app["args"][key] = {**base, **value} if isinstance(base, dict) and isinstance(value, dict) else value
    for d in app["deployments"]:
        d.update((pools or {}).get(d["name"], {}))
    apply_serve_config(config)
    wait_running(app["name"], 600)
    try:
        yield app
    finally:
        serve.delete(app["name"])


def replica_stats(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/debug/stats", timeout=10) as r:
        return json.load(r)["replicas"]


def emit(result: dict[str, Any], out: str | None) -> dict[str, Any]:
    """A bench's result: JSON on stdout, and in `out` too when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
    return result
