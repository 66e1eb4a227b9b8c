"""Replicas that fail (reliability faults 1-4, 10, 15, 16 and 18 of research/ecosystem-reliability.md),
on a local Ray with real processes:
  - a prefill replica SIGKILLed before its hand-off: the request is retried on another prefill
    replica and completes; with no prefill replica at all, a fast 503 with Retry-After
  - a decode engine that wedges (its step loop stops) fails Serve's health check and the
    replica is replaced; a decode pool whose constructor fails makes the router answer 503
  - a router replica SIGKILLed mid-stream, and the Serve controller killed: serving goes on
  - a decode replica SIGKILLed mid-stream (the stream moves) or after the prefill (the lease
    frees the prefill's blocks), or stopped past the lease and resumed (late ack counted); a
    prefill replica dead before its KV is fetched (recompute)
Apps are deployed as `serve deploy` deploys them (apply_serve_config), pool options from YAML,
over the pools of tests/fault_pools.py (the real ones, with fault hooks a test arms), serving the
tiny random Llama: where a fault must land while a request runs, its pool's engine steps are
slowed from the start (TANDEM_TEST_STEP_PAUSE_S), so the timing is the test's, not the model's."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time

import pytest

from fault_pools import step_pause_env
from serving import (APP, SteadyStream, apply_config, chat_in_background, client, fresh, http_request, load_config,
                     open_stream, pool_stats, replica_stats, running_replicas, settled, wait_for, wait_for_replica)

pytestmark = pytest.mark.slow

# ~760 prompt tokens with the chat template: three prefill steps of 256 on the tiny random Llama
# (its context is 1,024), each slowed to PREFILL_PAUSE_S where a test acts while the prompt is computed
LONG = "Summarize these notes: " + " ".join(f"item{i} is filed under shelf {i % 7}" for i in range(80))
PREFILL_PAUSE_S = 0.6


def on_tiny(config_file: str, tiny_model_paths: dict, **engine: object) -> dict:
    """A config's app args serving the tiny random Llama (as "tiny"), these engine options over its."""
    args = load_config(config_file)["applications"][0]["args"]
    args.update(model=str(tiny_model_paths["llama"]), served_model_name="tiny")
    args["engine"] = {**args["engine"], **engine}
    return args


def config(args: dict, prefill: int | None, decode: int = 1, prefill_resources: dict | None = None,
           routers: int = 1, pauses: dict[str, float] | None = None, **decode_options) -> dict:
    """`pauses`: pool deployment → seconds every engine step of its replicas pauses, from their start
    (tests/fault_pools.py)."""
    pauses = pauses or {}
    paused = lambda name: step_pause_env(pauses[name]) if name in pauses else {}  # noqa: E731
    deployments = [{"name": "Router", "num_replicas": routers, "ray_actor_options": {"num_cpus": 0}},
                   {"name": "DecodePool", "num_replicas": decode,
                    "ray_actor_options": {"num_cpus": 0.5, **paused("DecodePool")}, **decode_options}]
    if prefill is not None:
        options = {"num_cpus": 0.5, **({"resources": prefill_resources} if prefill_resources else {}),
                   **paused("PrefillPool")}
        deployments.append({"name": "PrefillPool", "num_replicas": prefill, "ray_actor_options": options})
    return {"applications": [{"name": APP, "route_prefix": "/", "import_path": "fault_pools:build_app",
                              "args": args, "deployments": deployments}]}


def post_chat(url: str, body: dict) -> tuple[int, dict, dict]:
    status, headers, raw = http_request(url, "POST", "/v1/chat/completions", json.dumps(body).encode())
    return status, headers, json.loads(raw)


def test_prefill_replica_killed_before_handoff_is_retried_on_another(serve_url, tiny_model_paths):
    """On the tiny random Llama, its prefill steps slowed: the kill lands while the prompt is computed.
    The prompt is queued there for three slowed steps (3.6 s); the replica is found by stats posted
    within the last second, so the kill cannot land after the hand-off on a stale post (a loaded
    host can delay a post by more than the board's period)."""
    args = on_tiny("serve-tcp.yaml", tiny_model_paths, max_num_batched_tokens=256, cpu_kv_cache_bytes=64 << 20)
    fresh(config(args, prefill=2, pauses={"PrefillPool": 2 * PREFILL_PAUSE_S}),
          {"Router": 1, "DecodePool": 1, "PrefillPool": 2})
    worker, result = chat_in_background(serve_url, LONG, 8, model="tiny")
    # the replica that is prefilling our prompt
    busy = wait_for_replica(serve_url, lambda s: (s["pool"] == "prefill" and s["queued_prompt_tokens"] > 0
                                                  and time.time() - s["posted_at"] < 1.0), 30,
                            "a prefill replica to take the prompt")
    os.kill(busy["pid"], signal.SIGKILL)
    worker.join(timeout=120)
    assert result.get("finish") == "length" and result.get("tokens") == 8, result
    decode = next(s for s in replica_stats(serve_url) if s["pool"] == "decode")
    assert decode["prefill_retried"] >= 1 and decode.get("recomputed", 0) == 0  # the other replica did it
    assert decode["blocks_in_use"] == 0 and decode["num_running"] == 0 and decode["num_remote"] == 0


def test_no_prefill_replica_is_a_fast_503(serve_url, tiny_model_paths):
    args = {"model": str(tiny_model_paths["llama"]), "served_model_name": "tiny",
            "engine": {"num_blocks": 64}, "kv_transfer": {"connector": "shared_store"}}
    # a prefill pool that cannot be placed (this cluster has no "gpu_node" resource): 0 running
    cfg = config(args, prefill=1, prefill_resources={"gpu_node": 1})
    # (its replica never starts, so has nothing to drain, but deleting the app waits Serve's grace for it)
    cfg["applications"][0]["deployments"][-1]["graceful_shutdown_timeout_s"] = 1
    fresh(cfg, {"Router": 1, "DecodePool": 1, "PrefillPool": 0}, settled=False)
    # the router's look at its pools reads what serve.status() shows, from the controller's dict
    from cluster.router.app import running_replicas as routers_view
    assert routers_view(APP) == running_replicas(settled=False) and routers_view("no-such-app") is None
    start = time.monotonic()
    status, headers, body = post_chat(serve_url, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 503 and headers.get("retry-after") == "1", (status, body)
    assert body["error"]["code"] == "pool_unavailable" and "PrefillPool" in body["error"]["message"]
    assert time.monotonic() - start < 3.0
    status, _, body = http_request(serve_url, "GET", "/health")  # not ready: what `tandem up` waits on
    assert status == 503 and "PrefillPool" in json.loads(body)["error"]["message"]
    (decode,) = [s for s in replica_stats(serve_url) if s["pool"] == "decode"]
    assert decode["blocks_in_use"] == 0 and decode["num_remote"] == 0  # nothing was reserved


def test_wedged_decode_engine_fails_its_health_check_and_is_replaced(serve_url, tiny_model_paths):
    from ray import serve

    args = {"mode": "colocated", "model": str(tiny_model_paths["llama"]), "served_model_name": "tiny",
            "engine": {"num_blocks": 64}, "stall_timeout_s": 2}
    fresh(config(args, prefill=None, health_check_period_s=1, health_check_timeout_s=10),
          {"Router": 1, "DecodePool": 1})
    (before,) = [s["replica"] for s in replica_stats(serve_url) if s["pool"] == "decode"]
    serve.get_deployment_handle("DecodePool", APP).inject_fault.remote("wedge").result(timeout_s=10)

    def replaced() -> bool:
        ids = [s["replica"] for s in replica_stats(serve_url) if s["pool"] == "decode"]
        return bool(ids) and before not in ids and running_replicas() == {"Router": 1, "DecodePool": 1}

    wait_for(replaced, 90, "a new decode replica in place of the wedged one")
    status, _, body = post_chat(serve_url, {"model": "tiny", "max_tokens": 4, "ignore_eos": True,
                                           "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and body["usage"]["completion_tokens"] == 4


def test_decode_pool_whose_constructor_fails_gets_503_not_a_hang(serve_url, tiny_model_paths):
    from ray import serve

    args = {"mode": "colocated", "model": str(tiny_model_paths["llama"]), "served_model_name": "tiny",
            "engine": {"cpu_kv_cache_bytes": 1 << 50}}  # no machine has a PiB: the constructor raises
    serve.delete(APP)
    apply_config(config(args, prefill=None))
    wait_for(lambda: running_replicas(settled=False).get("Router") == 1, 120, "the router to run")
    start = time.monotonic()
    status, headers, body = post_chat(serve_url, {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert status == 503 and headers.get("retry-after") == "1", (status, body)
    assert "DecodePool" in body["error"]["message"] and time.monotonic() - start < 3.0
    serve.delete(APP)


def router_pids() -> list[int]:
    import ray

    return [a["Pid"] for a in ray._private.state.actors().values()
            if a["ActorClassName"] == f"ServeReplica:{APP}:Router" and a["State"] == "ALIVE"]


def test_router_replica_or_serve_controller_killed_serving_goes_on(serve_url, tiny_model_paths):
    """A router replica SIGKILLed mid-stream: that client's connection is cut (never a clean
    finish), the decode replica aborts the request at once, every request sent afterwards is
    served by the other router replica, and the dead one is replaced. Then the Serve controller
    killed: while it restarts and re-adopts the replicas, every request still succeeds (the
    router must not read "RECOVERING" replicas as an empty pool)."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    args = {"model": str(tiny_model_paths["llama"]), "served_model_name": "tiny", "engine": {"num_blocks": 128},
            "kv_transfer": {"connector": "tcp"}}
    cfg = config(args, prefill=1)
    fresh(cfg, {"Router": 1, "DecodePool": 1, "PrefillPool": 1})
    (first,) = router_pids()
    serve.get_deployment_handle("DecodePool", APP).inject_fault.remote("slow_steps").result(timeout_s=10)
    conn = open_stream(serve_url, "Tell me a story.", 900, model="tiny")  # through the only router
    cut = conn.getresponse()
    assert cut.status == 200 and cut.readline().startswith(b"data: {")
    cfg["applications"][0]["deployments"][0]["num_replicas"] = 2
    apply_config(cfg)
    wait_for(lambda: running_replicas().get("Router") == 2, 120, "a second router replica")

    killed_at = time.time()
    os.kill(first, signal.SIGKILL)
    with pytest.raises(http.client.IncompleteRead) as partial:
        cut.read()
    assert b"[DONE]" not in partial.value.partial and not re.search(rb'"finish_reason": ?"', partial.value.partial)
    with SteadyStream(serve_url, "tiny") as load:
        aborted = wait_for_replica(serve_url, lambda s: s["pool"] == "decode" and s["last_abort_at"] > killed_at,
                                   15, "the decode replica to abort the cut stream")
        assert aborted["last_abort_at"] - killed_at < 1.0
        wait_for(lambda: len(router_pids()) == 2 and first not in router_pids(), 120, "the dead router replaced")

        t_controller = time.monotonic()
        ray.kill(ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE), no_restart=False)
        wait_for(lambda: load.completed_since(t_controller + 5) >= 3, 120, "requests well after the restart")
    assert not load.failures, load.failures
    assert load.completed_since(t_controller) >= 6
    wait_for(lambda: running_replicas() == {"Router": 2, "DecodePool": 1, "PrefillPool": 1}, 60,
             "the restarted controller to report every replica running")
    for s in settled(serve_url).values():
        assert s["blocks_in_use"] == 0 and s["num_running"] == 0 and s.get("leases", 0) == 0, s


def test_decode_replica_stopped_past_the_lease_then_resumed_finishes_and_its_late_ack_is_counted(
        serve_url, tiny_model_paths):
    """SIGSTOP the decode replica once the prefill replica holds R's lease, SIGCONT it after the
    lease expired: the prefill side freed R's blocks on time and counts the late ack as late, the
    resumed decode replica finishes R with the same greedy text, and nobody crashed."""
    from ray import serve

    args = {"model": str(tiny_model_paths["llama"]), "served_model_name": "tiny", "engine": {"num_blocks": 128},
            "kv_transfer": {"connector": "shared_store", "lease_s": 1}}
    fresh(config(args, prefill=1), {"Router": 1, "DecodePool": 1, "PrefillPool": 1})
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a story."}]}
    expected = post_chat(serve_url, body)[2]["choices"][0]["message"]["content"]
    before = pool_stats(serve_url, ("prefill", "decode"))
    serve.get_deployment_handle("DecodePool", APP).inject_fault.remote("delay_fetch").result(timeout_s=10)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(zip(("status", "headers", "body"), post_chat(serve_url, body))))
    worker.start()
    wait_for_replica(serve_url, lambda s: s["pool"] == "prefill" and (s.get("leases", 0) or s.get("lease_expired", 0)),
                     30, "R's lease")  # (a slow posting may first show it expired: decode waits 1.5 s)
    os.kill(before["decode"]["pid"], signal.SIGSTOP)
    try:
        wait_for_replica(serve_url, lambda s: s["pool"] == "prefill" and s.get("lease_expired", 0) == 1
                         and s["blocks_in_use"] == 0, 15, "the lease to expire while decode is stopped")
    finally:
        os.kill(before["decode"]["pid"], signal.SIGCONT)
    worker.join(timeout=60)
    assert result["status"] == 200 and result["body"]["choices"][0]["message"]["content"] == expected, result
    after = settled(serve_url)
    assert after["prefill"]["late_acks"] == 1 and after["prefill"]["lease_expired"] == 1
    for pool in ("prefill", "decode"):
        s = after[pool]
        assert s["pid"] == before[pool]["pid"] and s["blocks_in_use"] == 0 and s.get("leases", 0) == 0, s
    assert post_chat(serve_url, body)[0] == 200


def stream_text(url: str, content: str, max_tokens: int, on_chunk=None) -> tuple[str, str | None, dict | None]:
    """Stream a greedy chat completion over raw HTTP: (text, finish_reason, error object)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    text, finish, error, n = [], None, None, 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            error = chunk["error"]
            continue
        choice = chunk["choices"][0]
        text.append(choice["delta"].get("content") or "")
        finish = choice["finish_reason"] or finish
        n += 1
        if on_chunk is not None:
            on_chunk(n)
    conn.close()
    return "".join(text), finish, error


def kill_the_busy_decode_replica(url: str) -> None:
    busy = [s for s in replica_stats(url) if s["pool"] == "decode" and s["num_running"] > 0]
    assert len(busy) == 1, busy
    os.kill(busy[0]["pid"], signal.SIGKILL)


def test_decode_replica_killed_mid_stream_the_stream_moves_to_another(serve_url, tiny_model_paths):
    """With migration off, the client is told (an error chunk, no clean finish). With it on, and
    speculative decoding on, the stream goes on on the other replica with the tokens it gets
    without either: the new replica drafts from the stream's token ids alone. On the tiny random
    Llama, each decode step slowed to 50 ms: a 96-token stream lasts ~5 s."""
    # float32: the moved stream's prompt is recomputed, and bf16 could break a near-tie otherwise
    args = on_tiny("colocated.yaml", tiny_model_paths, cpu_kv_cache_bytes=64 << 20, dtype="float32")
    slowed = {"DecodePool": 0.05}
    prompt = "Tell me a long story about a lighthouse keeper."
    fresh(config({**args, "max_migrations": 0}, prefill=None, decode=2, pauses=slowed), {"Router": 1, "DecodePool": 2})
    reference, finish, error = stream_text(serve_url, prompt, 96)
    assert finish == "length" and error is None

    killed = threading.Event()

    def kill_at(n: int) -> None:
        if n == 16 and not killed.is_set():  # (the replica posts its stats within 0.5 s: ~20-60 tokens on)
            killed.set()
            kill_the_busy_decode_replica(serve_url)

    cut, finish, error = stream_text(serve_url, prompt, 96, on_chunk=kill_at)
    assert killed.is_set() and finish is None
    assert error is not None and error["code"] == 503 and reference.startswith(cut)
    wait_for(lambda: running_replicas() == {"Router": 1, "DecodePool": 2}, 120, "the killed replica replaced")
    for s in replica_stats(serve_url):
        assert s["blocks_in_use"] == 0 and s["num_running"] == 0, s

    # always drafting: adaptive would fit the tiny model's step cost, where a draft token costs
    # about what a step does (the pause aside), and rightly draft nothing
    spec = {"method": "ngram", "prompt_lookup_min": 1, "adaptive": False}
    fresh(config({**args, "speculative_config": spec}, prefill=None, decode=2, pauses=slowed),
          {"Router": 1, "DecodePool": 2})
    killed.clear()
    moved, finish, error = stream_text(serve_url, prompt, 96, on_chunk=kill_at)
    assert killed.is_set()
    assert error is None and finish == "length"
    assert moved == reference  # greedy: the other replica went on exactly where the dead one stopped
    survivor = [s for s in replica_stats(serve_url) if s["pool"] == "decode" and s["generation_tokens"]]
    assert survivor and all(s["spec_num_draft_tokens"] > 0 for s in survivor)


def test_decode_replica_killed_after_prefill_the_prefill_blocks_return_within_the_lease(serve_url, tiny_model_paths):
    """On the tiny random Llama, its prefill steps slowed: the kill lands while the prompt is computed."""
    args = on_tiny("serve-shared-store.yaml", tiny_model_paths, max_num_batched_tokens=256, cpu_kv_cache_bytes=64 << 20)
    args["kv_transfer"] = {**args["kv_transfer"], "lease_s": 3}
    fresh(config(args, prefill=1, decode=2, pauses={"PrefillPool": PREFILL_PAUSE_S}),
          {"Router": 1, "DecodePool": 2, "PrefillPool": 1})
    worker, result = chat_in_background(serve_url, LONG, 8, model="tiny")
    # the decode replica waiting on the prefill of our prompt
    waiting = wait_for_replica(serve_url, lambda s: s["pool"] == "decode" and s["num_remote"] > 0, 30,
                               "a decode replica to reserve the prompt")
    os.kill(waiting["pid"], signal.SIGKILL)

    def prefill() -> dict:
        return pool_stats(serve_url, ("prefill",))["prefill"]

    # the prefill finishes (however long this machine takes for the long prompt), its lease
    # starts, and the dead replica never acknowledges: the lease frees the prompt's blocks
    seen: dict[str, float] = {}

    def expired() -> bool:
        p = prefill()
        if p.get("leases", 0) >= 1:
            seen.setdefault("lease", time.monotonic())
        return p.get("lease_expired", 0) >= 1

    wait_for(expired, 60, "the dead decode replica's lease to expire")
    assert "lease" in seen, "the lease was never seen held"
    assert time.monotonic() - seen["lease"] < 3 + 5  # the lease (3 s), the reaper's period, the stats' lag
    worker.join(timeout=120)
    assert result.get("finish") == "length", result  # the stream moved to the other decode replica
    def idle() -> bool:
        p = prefill()
        return p["blocks_in_use"] == 0 and p["leases"] == 0

    wait_for(idle, 30, "the prefill replica to hold no blocks and no leases")


def test_prefill_dies_after_putting_the_kv_the_failure_policy_recomputes(serve_url, tiny_model_paths):
    """On the tiny random Llama: the faults are timed by the clock (the prefill replica exits
    0.3 s after its hand-off, the decode replica fetches 1.5 s after it), not by the model."""
    from ray import serve

    args = on_tiny("serve-shared-store.yaml", tiny_model_paths, cpu_kv_cache_bytes=64 << 20)
    fresh(config(args, prefill=1), {"Router": 1, "DecodePool": 1, "PrefillPool": 1})
    c = client(serve_url)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    expected = c.chat.completions.create(model="tiny", temperature=0, max_tokens=12,
                                         messages=question).choices[0].message.content
    # the prefill replica puts R's KV in the object store, answers, and dies 0.3 s later; the
    # decode replica fetches after 1.5 s: the KV's owner is gone, so the fetch fails
    serve.get_deployment_handle("PrefillPool", APP).inject_fault.remote("exit_after_handoff").result(timeout_s=10)
    serve.get_deployment_handle("DecodePool", APP).inject_fault.remote("delay_fetch").result(timeout_s=10)
    r = c.chat.completions.create(model="tiny", temperature=0, max_tokens=12, messages=question)
    assert r.choices[0].message.content == expected  # recomputed on the decode replica: same text
    (decode,) = [s for s in replica_stats(serve_url) if s["pool"] == "decode"]
    assert decode["recomputed"] >= 1 and any(k.startswith("kv_failed_") and v for k, v in decode.items()), decode
    assert decode["blocks_in_use"] == 0 and decode["num_remote"] == 0
    wait_for(lambda: running_replicas() == {"Router": 1, "DecodePool": 1, "PrefillPool": 1}, 120,
             "the dead prefill replica replaced")
