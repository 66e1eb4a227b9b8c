"""The cluster for real: a local Ray, Ray Serve apps built from configs/, HTTP through the
`openai` SDK. The default model, disaggregated over each connector and colocated."""

from __future__ import annotations

import concurrent.futures

import pytest

from serving import args_of, client, deploy, replica_stats

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]


def greedy(c, model: str) -> list[str]:
    return [c.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], temperature=0,
                                      max_tokens=24).choices[0].message.content for p in PROMPTS]


def test_disaggregated_app_end_to_end(serve_url):
    deploy(args_of("serve.yaml"))
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
    landed = {}
    for name in ("colocated.yaml", "serve-tcp.yaml", "serve-shared-store.yaml", "serve-collective.yaml"):
        deploy(args_of(name))
        c = client(serve_url)
        outputs[name] = greedy(c, c.models.list().data[0].id)
        landed[name] = sum(s.get("kv_landed", 0) for s in replica_stats(serve_url, settle_s=1.5))
    for name in ("serve-tcp.yaml", "serve-shared-store.yaml", "serve-collective.yaml"):
        assert outputs[name] == outputs["colocated.yaml"], name
        assert landed[name] == len(PROMPTS), name  # each prompt's KV crossed this connector
    assert "Paris" in outputs["colocated.yaml"][0]
