"""Must-show 4 of the cluster issue: under a steady request stream, redeploying the Serve config
with 1P1D → 2P1D → 1P2D changes the pools (Serve's replica counts, and every new replica serves)
and no request fails; then back to 1P1D, the leaving decode replica draining its streams
(reliability fault 11: scale-down under load), within seconds of its streams' end. Deployed the
way `serve deploy configs/serve.yaml` deploys: the whole config, pool sizes and actor options from
YAML, handed to the Serve controller. With two prefill replicas, a conversation's next turn goes
where its history is cached. And the prefill pool autoscales on its queued prompt tokens. All on a
tiny random Llama with the default model's tokenizer: what they check is the pools, not the
model's words, and its replicas start and answer in a fraction of the default model's time.
"""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

from serving import (APP, SteadyStream, apply_config, client, http_request, hand_off_config, load_config, replica_stats,
                     running_replicas, wait_for)

pytestmark = pytest.mark.slow

TINY = "tiny"  # the served model name of the tiny random Llama


def sized(prefill: int, decode: int, model: str) -> dict:
    """configs/serve.yaml serving `model` (as TINY), with these pool sizes, each pool replica on
    half a core (3 fit on 2 CPUs)."""
    config = hand_off_config("serve.yaml")
    app = config["applications"][0]
    app["args"].update(model=model, served_model_name=TINY)
    app["args"]["engine"]["cpu_kv_cache_bytes"] = 128 << 20
    for d in app["deployments"]:
        if d["name"] in ("PrefillPool", "DecodePool"):
            d["num_replicas"] = prefill if d["name"] == "PrefillPool" else decode
            d["ray_actor_options"] = {"num_cpus": 0.5}
    return config


def pools_are(prefill: int, decode: int):
    return lambda: running_replicas() == {"Router": 1, "PrefillPool": prefill, "DecodePool": decode}


def per_replica(url: str, pool: str, counter: str) -> dict[str, int]:
    return {s["replica"]: s.get(counter, 0) for s in replica_stats(url) if s["pool"] == pool}


def reported_caches(deployment: str) -> dict[str, set[bytes]]:
    """Per replica of `deployment`: the prefix-cache block hashes it last reported, as Serve's
    controller holds them, which is what it broadcasts to that pool's request routers."""
    import ray
    from ray.serve._private.common import DeploymentID
    from ray.serve.context import _get_global_client

    from cluster.cache_report import HASH_BYTES

    container = ray.get(_get_global_client()._controller._dump_replica_states_for_testing.remote(
        DeploymentID(name=deployment, app_name=APP)))
    views = {}
    for replica in container.get():
        blob = (replica.routing_stats or {}).get("cached_blocks", b"")
        views[replica.replica_id.unique_id] = {blob[i:i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)}
    return views


def test_redeploying_pool_sizes_under_load_fails_no_request(serve_url, tiny_model_paths):
    from ray import serve

    tiny = str(tiny_model_paths["llama"])
    apply_config(sized(1, 1, tiny))
    wait_for(pools_are(1, 1), 240, "1 prefill + 1 decode replica")
    model = client(serve_url).models.list().data[0].id

    with SteadyStream(serve_url, model) as load:
        wait_for(lambda: load.completed_since(0) >= 3, 120, "the first requests")

        t_2p1d = time.monotonic()
        apply_config(sized(2, 1, tiny))
        wait_for(pools_are(2, 1), 240, "2 prefill replicas")
        # the new prefill replica takes its share (the prompts are new to both: routed by the work queued)
        wait_for(lambda: len([n for n in per_replica(serve_url, "prefill", "kv_sent").values() if n > 0]) == 2,
                 120, "both prefill replicas to push KV")
        prefill_replicas = set(per_replica(serve_url, "prefill", "kv_sent"))

        t_1p2d = time.monotonic()
        apply_config(sized(1, 2, tiny))
        wait_for(pools_are(1, 2), 240, "1 prefill + 2 decode replicas")
        wait_for(lambda: len([n for n in per_replica(serve_url, "decode", "kv_landed").values() if n > 0]) == 2,
                 120, "both decode replicas to admit transferred KV")
        # scale-down of the decode pool under load: the leaving replica drains its streams, and
        # stops once they end (the router's channel to it closes when idle), not when Serve's
        # grace period (graceful_shutdown_timeout_s, 20 s by default) runs out
        t_1p1d = time.monotonic()
        apply_config(sized(1, 1, tiny))
        wait_for(pools_are(1, 1), 240, "back to 1 prefill + 1 decode replica")
        t_end = time.monotonic()
        assert t_end - t_1p1d < 15, f"the scale-down took {t_end - t_1p1d:.1f} s"
        wait_for(lambda: load.completed_since(t_end) >= 3, 120, "requests after the last change")

    assert not load.failures, load.failures
    assert (load.completed_since(t_2p1d) > load.completed_since(t_1p2d) > load.completed_since(t_1p1d)
            > load.completed_since(t_end) >= 3)
    assert len(prefill_replicas) == 2
    stats = replica_stats(serve_url)  # (each fresh: the replicas gone have left the board)
    assert sorted(s["pool"] for s in stats) == ["decode", "prefill"]
    for s in stats:
        assert s["blocks_in_use"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0, s
    serve.delete(APP)


def test_a_conversations_next_turn_is_prefilled_where_its_history_is_cached(serve_url, tiny_model_paths):
    """Two prefill replicas. Four conversations' first turns, sent at once, spread over both;
    each one's second turn, sent alone to an idle pool, goes back to the replica that holds
    its history, which serves all of that from its prefix cache (a prefix cache is per replica:
    elsewhere it would be computed again). The decode replica holds the history too: only the
    new turn's KV blocks are sent to it."""
    apply_config(sized(2, 1, str(tiny_model_paths["llama"])))
    wait_for(pools_are(2, 1), 240, "2 prefill replicas + 1 decode replica")
    c = client(serve_url)

    def turn(conversation: int, messages: list[dict]) -> tuple[object, dict]:
        rid = f"conversation-{conversation}-turn-{len(messages) // 2 + 1}"
        r = c.chat.completions.create(model=TINY, messages=messages, max_tokens=4,
                                      temperature=0, extra_headers={"X-Request-Id": rid})
        (trace,) = json.loads(http_request(serve_url, "GET", f"/debug/requests/{rid}")[2])["traces"]
        return r, trace

    histories = [[{"role": "user", "content": f"Ledger {k}: " + " ".join(
        f"crate{j} of batch {k} went to dock {(j * (k + 3)) % 13}" for j in range(14))}] for k in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        firsts = list(pool.map(turn, range(4), histories))
    assert len({trace["prefill_replica"] for _, trace in firsts}) == 2  # the burst spread over both replicas
    # each history's blocks reported by the replica that computed it, before its next turn is routed
    from cluster.cache_report import prompt_hashes

    histories_blocks = [prompt_hashes(json.loads(http_request(serve_url, "POST", "/tokenize", json.dumps(
        {"messages": history}).encode())[2])["tokens"], 16, None) for history in histories]
    wait_for(lambda: all(set(blocks) <= reported_caches("PrefillPool").get(trace["prefill_replica"], set())
                         for blocks, (_, trace) in zip(histories_blocks, firsts)),
             30, "each history's blocks in its prefill replica's routing report")
    for k, (first, trace) in enumerate(firsts):
        messages = histories[k] + [{"role": "assistant", "content": first.choices[0].message.content},
                                   {"role": "user", "content": "Which dock got crate3?"}]
        second, trace2 = turn(k, messages)
        history_blocks = first.usage.prompt_tokens // 16
        assert trace2["prefill_replica"] == trace["prefill_replica"], k
        assert second.usage.prompt_tokens_details.cached_tokens >= 16 * history_blocks, k
        sent = [-(-r.usage.prompt_tokens // 16) - t["kv_reused_tokens"] // 16 for r, t in ((first, trace), (second, trace2))]
        assert trace2["kv_reused_tokens"] >= 16 * history_blocks, k
        assert trace2["kv_bytes"] == trace["kv_bytes"] // sent[0] * sent[1], k  # the new blocks alone


def test_the_prefill_pool_autoscales_on_the_prompt_tokens_queued_to_compute(serve_url, tiny_model_paths):
    """configs/serve-autoscaling.yaml, its delays shortened, serving the tiny random Llama over the
    pools of tests/fault_pools.py, each prefill step (512 prompt tokens) slowed to 2 s: four prompts
    queue ~3,700 prompt tokens, more than one prefill replica's target (2,048), so Serve starts a
    second one (its default policy, 2 ongoing requests per replica, would not), while the decode
    pool, far from its targets, stays at one; idle again, the pool goes back to one. Every request
    is answered."""
    from fault_pools import step_pause_env

    config = load_config("serve-autoscaling.yaml")
    app = config["applications"][0]
    app["import_path"] = "fault_pools:build_app"
    app["args"].update(model=str(tiny_model_paths["llama"]), served_model_name=TINY)
    app["args"]["engine"]["cpu_kv_cache_bytes"] = 64 << 20
    for d in app["deployments"]:
        if "autoscaling_config" in d:
            d["autoscaling_config"].update(upscale_delay_s=1, downscale_delay_s=2, look_back_period_s=2)
        if d["name"] == "PrefillPool":
            # ~16 s of prefill in all: the load outlasts a new replica's start on a slow host
            d["ray_actor_options"] = {**d["ray_actor_options"], **step_pause_env(2.0)}
    apply_config(config)
    wait_for(pools_are(1, 1), 240, "1 prefill + 1 decode replica")
    c = client(serve_url)
    prefill = lambda: running_replicas(settled=False).get("PrefillPool", 0)  # noqa: E731

    def ask(k: int):  # ~920 prompt tokens (of the tiny model's 1,024), new to every cache
        notes = " ".join(f"bale{(j * 7 + k) % 97} went north" for j in range(150))
        return c.chat.completions.create(model=TINY, max_tokens=4, temperature=0,
                                         messages=[{"role": "user", "content": f"Shipment {k}: {notes}"}])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = [pool.submit(ask, k) for k in range(4)]  # ~3,700 tokens: 2,048 per replica wants 2
        wait_for(lambda: prefill() == 2, 120, "a second prefill replica (max_replicas 2)")
        replies = [r.result(timeout=300) for r in replies]
    assert all(r.choices[0].finish_reason == "length" for r in replies)
    assert sum(r.usage.prompt_tokens for r in replies) > 3600
    assert running_replicas(settled=False).get("DecodePool") == 1  # 4 requests, a sliver of its KV cache
    wait_for(lambda: prefill() == 1, 120, "the prefill pool back to one replica once idle")
