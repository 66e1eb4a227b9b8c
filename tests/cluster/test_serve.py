"""The cluster for real: a local Ray, Ray Serve apps built from configs/, HTTP through the
`openai` SDK. One disaggregated app of the default model, end to end: the API, concurrency,
metrics, traces, and the shared store's hand-offs (replies across modes, connectors and
speculation: test_identical_replies.py)."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import resource
import time
from pathlib import Path

import pytest

from cluster.cpu_binding import OWN_NICE, SHARED_NICE
from cluster.decode.channels import IDLE_CLOSE_S
from serving import (APP, apply_config, client, fresh, hand_off_config, replica_stats, running_replicas,
                     scrape, settled, total, wait_for)

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
@pytest.fixture(scope="module")
def disaggregated(serve_url):
    """configs/serve.yaml deployed once, as `serve deploy` deploys it (its pools' options from
    YAML), for the tests that share it (each still passes alone); a test may scale its routers."""
    fresh(hand_off_config("serve.yaml"), {"Router": 1, "PrefillPool": 1, "DecodePool": 1})
    return serve_url


def test_disaggregated_app_end_to_end(disaggregated):
    serve_url = disaggregated
    c = client(serve_url)
    model = c.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"

    r = c.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    # vLLM's continue_final_message: the reply goes on with the assistant's own words
    go_on = c.chat.completions.create(model=model, temperature=0, max_tokens=4, messages=QUESTION + [
        {"role": "assistant", "content": "The capital of France is"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert go_on.choices[0].message.content.startswith(" Paris")
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # vLLM's structured_outputs: the reply is exactly one of the choices, and the right one
    pick = c.chat.completions.create(model=model, temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": "What is the capital of France? Answer with one word."}],
        extra_body={"structured_outputs": {"choice": ["Berlin", "Madrid", "Paris", "Rome"]}})
    assert pick.choices[0].message.content == "Paris" and pick.choices[0].finish_reason == "stop"

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
    # asked again: the prefill pool's prefix cache served the question's whole blocks
    assert r.usage.prompt_tokens > usage.prompt_tokens_details.cached_tokens >= 16

    two = c.chat.completions.create(model=model, messages=QUESTION, n=2, temperature=1.0, seed=11, max_tokens=16)
    assert [ch.index for ch in two.choices] == [0, 1] and all(ch.message.content for ch in two.choices)
    # a seed repeats its reply: one request at a time, so each runs its steps alone both times
    # (this app is bf16, where another batch shape can tip a near-tie: test_identical_replies
    # checks n=2 sampled replies across apps, in float32)
    once, again = (c.chat.completions.create(model=model, messages=QUESTION, temperature=1.0, seed=11,
                                             max_tokens=16).choices[0].message.content for _ in range(2))
    assert once == again

    cut = c.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=32, stop=["Paris"])
    assert "Paris" not in cut.choices[0].message.content and cut.choices[0].finish_reason == "stop"

    comp = c.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert comp.choices[0].text and comp.usage.completion_tokens == 4

    batch = c.completions.create(model=model, prompt=["The capital of France is", "The capital of Italy is"],
                                 temperature=0, max_tokens=4)
    assert [ch.index for ch in batch.choices] == [0, 1]
    assert batch.choices[0].text == comp.choices[0].text and "Paris" in batch.choices[0].text
    assert "Rome" in batch.choices[1].text and batch.usage.completion_tokens == 8

    from cluster.engine.tokenizer import Tokenizer
    from cluster.models.default_model import default_model_path

    paris = Tokenizer(str(default_model_path())).encode(" Paris")
    assert len(paris) == 1
    banned = c.completions.create(model=model, prompt="The capital of France is", temperature=0, max_tokens=4,
                                  logit_bias={str(paris[0]): -100})
    assert banned.choices[0].text and not banned.choices[0].text.startswith(" Paris")

    def loglikelihood(answer: str) -> float:  # lm-eval's request: echo + logprobs + max_tokens 1
        scored = c.completions.create(model=model, prompt="The capital of France is" + answer, echo=True,
                                      logprobs=1, max_tokens=1, temperature=0).choices[0]
        assert scored.text.startswith("The capital of France is" + answer) and scored.logprobs.token_logprobs[0] is None
        return scored.logprobs.token_logprobs[-2]  # the answer's own token (" Paris", " London": one token each)
    assert loglikelihood(" Paris") > loglikelihood(" London") + 1.0
    # vLLM's prompt_logprobs, as its users send it (extra_body): " Paris" ranks first after the question
    scores = c.completions.create(model=model, prompt="The capital of France is Paris", max_tokens=1,
                                  extra_body={"prompt_logprobs": 2}).choices[0].prompt_logprobs
    assert scores[0] is None and scores[-1][str(paris[0])]["rank"] == 1
    assert scores[-1][str(paris[0])]["logprob"] == pytest.approx(loglikelihood(" Paris"), abs=1e-3)

    cat = [{"role": "user", "content": "Give me a JSON object describing a cat with keys name, age and color."}]
    as_json = c.chat.completions.create(model=model, messages=cat, temperature=0, max_tokens=80,
                                        response_format={"type": "json_object"})
    assert {"name", "age", "color"} <= json.loads(as_json.choices[0].message.content).keys()
    assert as_json.choices[0].finish_reason == "stop"

    # structured output as the SDK asks for it: a pydantic model becomes a strict json_schema
    from pydantic import BaseModel

    class Capital(BaseModel):
        country: str
        capital: str

    parsed = c.chat.completions.parse(model=model, messages=QUESTION, temperature=0, max_tokens=60,
                                      response_format=Capital)
    assert parsed.choices[0].message.parsed.capital == "Paris" and parsed.choices[0].finish_reason == "stop"

    # tool calls as the SDK makes them: a pydantic function tool, called by name, then by "required"
    # (one call: left to make several, this model repeats the same call until max_tokens)
    import openai

    class GetWeather(BaseModel):
        city: str

    class GetTime(BaseModel):
        timezone: str

    weather = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    tools = [openai.pydantic_function_tool(GetWeather), openai.pydantic_function_tool(GetTime)]
    named = c.chat.completions.parse(model=model, messages=weather, temperature=0, max_tokens=40, tools=tools,
                                     tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    [call] = named.choices[0].message.tool_calls
    assert call.function.parsed_arguments.city == "Paris" and named.choices[0].finish_reason == "stop"
    calls: dict[int, dict] = {}
    for chunk in c.chat.completions.create(model=model, messages=weather, temperature=0, max_tokens=80, tools=tools,
                                           tool_choice="required", parallel_tool_calls=False, stream=True):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            calls.setdefault(d.index, {"name": d.function.name, "arguments": ""})["arguments"] += d.function.arguments
    assert calls and all(v["name"] in ("GetWeather", "GetTime") for v in calls.values())
    assert {"city": "Paris"} in [json.loads(v["arguments"]) for v in calls.values()]
    answer = c.chat.completions.create(model=model, temperature=0, max_tokens=30, tools=tools, tool_choice="none",
                                       messages=[*weather, {"role": "assistant", "tool_calls": [{
                                           "id": call.id, "type": "function", "function": {
                                               "name": "GetWeather", "arguments": call.function.arguments}}]},
                                           {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}])
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls

    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4", messages=QUESTION)
    card = c.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=model, messages=[])


def test_32_concurrent_streams_then_no_blocks_in_use(disaggregated):
    serve_url = disaggregated
    c = client(serve_url)
    model = c.models.list().data[0].id

    def one(i: int) -> str | None:
        finish = None
        for chunk in c.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Count to {i}."}],
                                               temperature=0.7, seed=i, max_tokens=24, stream=True):
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
        return finish

    def multiplexed() -> float:  # streams the routers took over their channels (decode/channels.py)
        return total(scrape(serve_url), "tandem:token_streams_total", path="multiplexed")

    before, migrations = multiplexed(), total(scrape(serve_url), "tandem:migrations_total")
    time.sleep(IDLE_CLOSE_S + 0.5)  # a burst after a pause: the channels closed while idle
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        finishes = list(pool.map(one, range(32)))
    assert all(f in ("stop", "length") for f in finishes), finishes
    # the burst's tokens came over the router's channel (one message per step), not one stream each
    # (the first may take its own while the channel reopens); the routers' counts reach /metrics with
    # their next post
    wait_for(lambda: multiplexed() - before >= 24, 10, "the burst's streams counted as multiplexed")
    assert total(scrape(serve_url), "tandem:migrations_total") == migrations  # no channel failed under them
    stats = settled(serve_url)
    assert set(stats) == {"prefill", "decode"}
    for s in stats.values():
        assert s["blocks_in_use"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0, s
    assert stats["decode"]["kv_landed"] >= 32  # every request's KV came over the connector


def test_the_decode_replica_runs_on_a_core_of_its_own_and_the_prefill_replica_beside_it(disaggregated):
    """cpu_binding, on by default: every thread of the decode replica is on one core no other
    replica of ours runs on (what `taskset -p` shows); the prefill replica's on the rest, at a
    raised priority where this user may raise one (what `ps -L -o nice` shows), the decode
    replica's at nice 0 there (Ray starts them at 15)."""
    cores = sorted(os.sched_getaffinity(0))  # this test process is unpinned: the node's cores
    stats: dict = {}

    def settled_binding() -> bool:  # a prefill replica up before the decode one moves within 5 s
        stats.update({s["pool"]: s for s in replica_stats(disaggregated)})
        own = stats["decode"]["cpus"]["cores"]
        return stats["prefill"]["cpus"]["cores"] == ([c for c in cores if c not in own] or cores)

    wait_for(settled_binding, 15, "the prefill replica on the cores the decode replica leaves")
    decode, prefill = stats["decode"]["cpus"], stats["prefill"]["cpus"]
    assert decode["mode"] == "own" and len(decode["cores"]) == 1 and decode["cores"][0] in cores
    assert prefill["mode"] == "shared" and prefill["cores"] == ([c for c in cores if c not in decode["cores"]] or cores)
    may_raise = os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20 - SHARED_NICE
    nices = {}
    for s, want in ((stats["decode"], decode), (stats["prefill"], prefill)):
        for task in Path(f"/proc/{s['pid']}/task").iterdir():
            allowed = re.search(r"Cpus_allowed_list:\s*(\S+)", (task / "status").read_text()).group(1)
            assert cpu_list(allowed) == want["cores"], (s["pool"], task.name, allowed)
            nice = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])  # field 19: nice
            nices.setdefault(s["pool"], set()).add(nice)
    # Ray runs a worker's Python threads at nice 15 (RAY_worker_niceness), its gRPC threads at 0
    if may_raise:
        assert nices["decode"] == {OWN_NICE} and decode["nice"] == OWN_NICE
        assert nices["prefill"] == {SHARED_NICE} and prefill["nice"] == SHARED_NICE
    else:
        assert min(nices["decode"]) >= 0 and decode["nice"] == max(nices["decode"])
        assert min(nices["prefill"]) >= 0 and prefill["nice"] == max(nices["prefill"])


def cpu_list(text: str) -> list[int]:
    """'0-2,5' → [0, 1, 2, 5]"""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def test_metrics_aggregate_every_replica_of_both_pools(disaggregated):
    serve_url = disaggregated

    c = client(serve_url)
    settled(serve_url)  # the earlier tests' requests counted on the board: a still baseline
    before = scrape(serve_url)
    usage = [c.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=8,
                                       extra_body={"ignore_eos": True},
                                       messages=[{"role": "user", "content": f"Count to {i}."}]).usage
             for i in range(4)]
    settled(serve_url)
    deadline = time.monotonic() + 10
    while True:  # what the pools count as a request ends reaches the board with their next post
        after = scrape(serve_url)
        landed = [total(after, name, pool=pool) - total(before, name, pool=pool) for name, pool in (
            ("vllm:request_success_total", "decode"), ("tandem:kv_transfer_seconds_count", "prefill"),
            ("tandem:kv_transfer_seconds_count", "decode"), ("vllm:e2e_request_latency_seconds_count", "router"))]
        if min(landed) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.1)

    def grew(name: str, **match: str) -> float:
        return total(after, name, **match) - total(before, name, **match)

    assert grew("vllm:request_success_total", pool="decode", finished_reason="length") == 4
    assert grew("vllm:generation_tokens_total", pool="decode") == 4 * 8
    assert grew("vllm:prompt_tokens_total", pool="prefill") == sum(u.prompt_tokens for u in usage)
    assert grew("vllm:prompt_tokens_total", pool="decode") == 0  # prompts are computed on the prefill pool
    assert grew("vllm:time_to_first_token_seconds_count", pool="router") == 4
    assert grew("vllm:e2e_request_latency_seconds_count", pool="router") == 4
    assert grew("vllm:inter_token_latency_seconds_count", pool="decode") == 4 * 7  # between 8 tokens, 7 gaps
    assert grew("tandem:kv_transfer_seconds_count", pool="prefill") == 4  # sends
    assert grew("tandem:kv_transfer_seconds_count", pool="decode") == 4  # receives
    sent, received = grew("tandem:kv_transfer_bytes_total", pool="prefill"), grew("tandem:kv_transfer_bytes_total", pool="decode")
    assert sent == received > 0
    # what decode's prefix cache held was not sent: the four prompts share the chat template's
    # system prompt. Per token: 30 layers x K and V x 3 KV heads x 64 elements, fp32 or bf16
    reused = grew("tandem:kv_reused_blocks_total", pool="decode")
    kv_dtype = next(s for s in replica_stats(serve_url) if s["pool"] == "decode")["kv_cache_dtype"]
    per_token = 30 * 2 * 3 * 64 * {"float32": 4, "bfloat16": 2}[kv_dtype]
    assert reused > 0 and sent == (sum(-(-u.prompt_tokens // 16) for u in usage) - reused) * 16 * per_token
    assert total(after, "vllm:num_requests_running") == 0 and total(after, "vllm:kv_cache_usage_perc") == 0
    ttft_le_inf = total(after, "vllm:time_to_first_token_seconds_bucket", pool="router", le="+Inf")
    assert ttft_le_inf == total(after, "vllm:time_to_first_token_seconds_count", pool="router")
    # one series per replica, named as /debug/stats names them
    replicas = {s["replica"] for s in replica_stats(serve_url)}
    labelled = {dict(labels)["replica"] for (n, labels), _ in after.items()
                if n == "vllm:kv_cache_usage_perc"}
    assert labelled == replicas and all(dict(labels)["model_name"] == "SmolLM2-135M-Instruct"
                                        for (n, labels), _ in after.items())


def test_each_request_is_traced_under_its_id(disaggregated):
    serve_url = disaggregated
    import glob
    import json

    import ray

    from serving import http_request

    body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 6,
                       "messages": [{"role": "user", "content": "Trace me."}]}).encode()
    status, headers, _ = http_request(serve_url, "POST", "/v1/chat/completions", body, {"X-Request-Id": "trace-me-1"})
    assert status == 200 and headers["x-request-id"] == "trace-me-1"
    status, headers, _ = http_request(serve_url, "POST", "/v1/chat/completions", body)
    made_up = headers["x-request-id"]  # none sent: Serve's own request id (its logs use it too)
    assert status == 200 and http_request(serve_url, "GET", f"/debug/requests/{made_up}")[0] == 200
    status, _, raw = http_request(serve_url, "POST", "/v1/chat/completions", body, {"X-Request-Id": "no spaces"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "X-Request-Id"

    status, _, raw = http_request(serve_url, "GET", "/debug/requests/trace-me-1")
    (trace,) = json.loads(raw)["traces"]
    pools = {s["pool"]: s["replica"] for s in replica_stats(serve_url)}
    assert trace["prefill_replica"] == pools["prefill"] and trace["decode_replica"] == pools["decode"]
    assert trace["kv"] == "landed" and trace["kv_bytes"] > 0 and trace["completion_tokens"] == 6
    for key in ("prefill_s", "kv_send_s", "kv_receive_s", "decode_queue_s", "ttft_s", "e2e_s"):
        assert 0 <= trace[key] < 60, key
    assert trace["kv_send_s"] <= trace["prefill_s"] <= trace["ttft_s"] <= trace["e2e_s"]
    # the same record as one JSON line in the router replica's log
    logs = ray._private.worker._global_node.get_logs_dir_path()
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for path in glob.glob(f"{logs}/**/*", recursive=True) if path.endswith((".err", ".log"))
                 for line in open(path, errors="replace") if line.startswith("{") and '"trace-me-1"' in line]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert lines == [trace]

    # two router replicas: whichever one a lookup lands on knows every request's trace
    from serving import apply_config, hand_off_config, running_replicas, wait_for

    config = hand_off_config("serve.yaml")
    config["applications"][0]["deployments"][0]["num_replicas"] = 2
    apply_config(config)
    wait_for(lambda: running_replicas().get("Router") == 2, 120, "a second router replica")
    ids = [f"two-routers-{i}" for i in range(12)]
    six = json.dumps({**json.loads(body), "ignore_eos": True}).encode()
    for rid in ids:
        assert http_request(serve_url, "POST", "/v1/chat/completions", six, {"X-Request-Id": rid})[0] == 200
    from cluster.stats_board import board

    on_board = board(APP)  # each router posts the traces it recorded with its stats
    wait_for(lambda: all(ray.get([on_board.trace.remote(rid) for rid in ids])), 30, "every trace on the stats board")
    served_by = set()
    for rid in ids * 3:
        status, _, raw = http_request(serve_url, "GET", f"/debug/requests/{rid}")
        assert status == 200, (rid, raw)
        (trace,) = json.loads(raw)["traces"]
        assert trace["request_id"] == rid and trace["completion_tokens"] == 6
        served_by.add(trace["router_replica"])
    assert len(served_by) == 2  # both routers served some (so lookups also met the other one)


def plasma_in_use() -> tuple[int, int]:
    """(MiB, objects) in the local Ray object store, as `ray memory --stats-only` reports them."""
    from ray._private.internal_api import memory_summary

    found = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", memory_summary(stats_only=True))
    assert found, "no plasma line in Ray's memory summary"
    return int(found[1]), int(found[2])


def test_shared_store_hand_offs_leave_nothing_in_the_object_store(serve_url):
    """configs/serve.yaml with Serve's by-value (gRPC) transport as every handle's default, as
    Ray's high-throughput mode (RAY_SERVE_THROUGHPUT_OPTIMIZED=1) sets it: a receipt's ObjectRef
    pickled by value would pin that prompt's KV (~46 KB a token) in the store for the prefill
    replica's life. After the requests, the store holds none of it."""
    from ray import serve

    config = hand_off_config("serve.yaml")
    config["applications"][0]["runtime_env"]["env_vars"]["RAY_SERVE_USE_GRPC_BY_DEFAULT"] = "1"
    serve.delete(APP)
    apply_config(config)
    wait_for(lambda: running_replicas() == {"Router": 1, "PrefillPool": 1, "DecodePool": 1}, 240, "the app")
    c = client(serve_url)
    model = c.models.list().data[0].id
    before = plasma_in_use()
    for i in range(6):  # ~200-token prompts: ~9 MB of KV each
        text = f"Note {i}: " + " ".join(f"box{j} holds {j * i % 11} apples" for j in range(40))
        c.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=2)
    decode = next(s for s in replica_stats(serve_url) if s["pool"] == "decode")
    assert decode["kv_landed"] >= 6  # each KV crossed the object store
    # acked KV leaves the store once its last reference is dropped, a moment after the ack: wait
    # for that (a pinned receipt never leaves), then check what is left
    def drained() -> bool:
        after = plasma_in_use()
        return after[0] - before[0] < 5 and after[1] - before[1] < 3

    wait_for(drained, 15, f"the hand-offs' KV to leave the object store (it held {before} before)")
