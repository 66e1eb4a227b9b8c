"""The cluster for real: a local Ray, Ray Serve apps built from configs/, HTTP through the
`openai` SDK. The default model, disaggregated over each connector and colocated."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time
import urllib.request

import pytest
import yaml

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(config_file: str) -> dict:
    return yaml.safe_load(open(f"configs/{config_file}"))["applications"][0]["args"]


@pytest.fixture(scope="module")
def serve_url(ray_local, default_model_path):
    from ray import serve

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def deploy(args: dict):
    """(Re)deploy the Tandem app with these args; returns when every replica is healthy."""
    from ray import serve

    from cluster.router.app import build_app

    serve.run(build_app(args), name="tandem", route_prefix="/")


def client(url: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def replica_stats(url: str, settle_s: float = 3.0) -> list[dict]:
    """Every replica's counters, after letting their periodic posts catch up."""
    time.sleep(settle_s)
    with urllib.request.urlopen(f"{url}/debug/stats", timeout=10) as r:
        return json.load(r)["replicas"]


def greedy(c, model: str) -> list[str]:
    return [c.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], temperature=0,
                                      max_tokens=24).choices[0].message.content for p in PROMPTS]


def test_disaggregated_app_end_to_end(serve_url):
    deploy(_args("serve.yaml"))
    c = client(serve_url)
    model = c.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"

    r = c.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    stream = c.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=32, stream=True,
                                       stream_options={"include_usage": True})
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == r.choices[0].message.content and finish == "stop"
    assert usage.completion_tokens == r.usage.completion_tokens

    two = c.chat.completions.create(model=model, messages=QUESTION, n=2, temperature=1.0, seed=11, max_tokens=16)
    again = c.chat.completions.create(model=model, messages=QUESTION, n=2, temperature=1.0, seed=11, max_tokens=16)
    assert [ch.message.content for ch in two.choices] == [ch.message.content for ch in again.choices]
    assert len(two.choices) == 2

    cut = c.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=32, stop=["Paris"])
    assert "Paris" not in cut.choices[0].message.content and cut.choices[0].finish_reason == "stop"

    comp = c.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert comp.choices[0].text and comp.usage.completion_tokens == 4

    import openai

    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4", messages=QUESTION)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=model, messages=[])


def test_32_concurrent_streams_then_no_blocks_in_use(serve_url):
    c = client(serve_url)
    model = c.models.list().data[0].id

    def one(i: int) -> str | None:
        finish = None
        for chunk in c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Count to {i}."}],
                                               temperature=0.7, seed=i, max_tokens=24, stream=True):
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
        return finish

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        finishes = list(pool.map(one, range(32)))
    assert all(f in ("stop", "length") for f in finishes), finishes
    stats = replica_stats(serve_url)
    assert {s["pool"] for s in stats} == {"prefill", "decode"}
    for s in stats:
        assert s["blocks_in_use"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0, s
    decode = next(s for s in stats if s["pool"] == "decode")
    assert decode["kv_landed"] >= 32  # every request's KV came over the connector


def test_greedy_identical_colocated_and_every_connector(serve_url):
    outputs = {}
    for name in ("colocated.yaml", "serve-tcp.yaml", "serve-shared-store.yaml"):
        deploy(_args(name))
        c = client(serve_url)
        outputs[name] = greedy(c, c.models.list().data[0].id)
    assert outputs["serve-tcp.yaml"] == outputs["colocated.yaml"]
    assert outputs["serve-shared-store.yaml"] == outputs["colocated.yaml"]
    assert "Paris" in outputs["colocated.yaml"][0]
