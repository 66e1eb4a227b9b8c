"""Helpers for the cluster tests: deploy Tandem on the session's local Ray, talk to it over
HTTP (the `openai` SDK, /debug/stats), and read Serve's own view of the pools."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from typing import Any, Callable

import yaml

APP = "tandem"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_config(config_file: str) -> dict[str, Any]:
    return yaml.safe_load(open(f"configs/{config_file}"))


def args_of(config_file: str) -> dict[str, Any]:
    return load_config(config_file)["applications"][0]["args"]


def deploy(args: dict[str, Any]) -> None:
    """(Re)deploy the Tandem app with these args through serve.run; returns when it is healthy."""
    from ray import serve

    from cluster.router.app import build_app

    serve.run(build_app(args), name=APP, route_prefix="/")


def apply_config(config: dict[str, Any]) -> None:
    """What `serve deploy FILE` does (see cluster.serve_config.apply_serve_config)."""
    from cluster.serve_config import apply_serve_config

    apply_serve_config(config)


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


def replica_stats(url: str, settle_s: float = 3.0) -> list[dict[str, Any]]:
    """Every replica's counters, after letting their periodic posts catch up."""
    time.sleep(settle_s)
    with urllib.request.urlopen(f"{url}/debug/stats", timeout=10) as r:
        return json.load(r)["replicas"]
