"""The same replies wherever they are made: colocated, disaggregated over each connector,
configs/serve.yaml as shipped (placement by SLO; its ITL SLO raised, below), with speculative
decoding on (a method per connector). A local Ray, Ray Serve apps built from configs/, HTTP
through the `openai` SDK.

Every app here runs float32 (`auto` is bf16 on a CPU where bf16 beats fp32): the paths compute
the same tokens with other batch shapes (a verify step's several rows, a prompt recomputed), and
bf16's rounding of the activations makes near-ties differ between them where fp32 does not."""

from __future__ import annotations

import concurrent.futures
import json

import pytest

from serving import shipped_args, args_of, client, deploy, in_float32, replica_stats, scrape, small_kv, total

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]
# serve.yaml's 150 ms ITL SLO is under what a short prompt's step costs on a slow CI host (a
# 2-core AVX2 EPYC: ~100 ms a decode step, ~400 ms one with a 70-token prompt), where placement
# then rightly sends every prompt to the pool; an SLO every host keeps for a short prompt's step
ITL_SLO_MS = 1000


def greedy(c, model: str) -> list[str]:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], temperature=0,
            max_tokens=24).choices[0].message.content, PROMPTS))


def seeded(c, model: str) -> list[str]:
    return [ch.message.content for ch in c.chat.completions.create(
        model=model, messages=QUESTION, temperature=1.0, seed=21, n=2, max_tokens=16).choices]


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
          "required": ["city", "country"]}


def stop_and_schema(c, model: str) -> list[str]:
    """A reply cut by a stop string, and one held to a JSON schema."""
    stop = c.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24, stop=["Paris"])
    shaped = c.chat.completions.create(
        model=model, temperature=0, max_tokens=40, messages=[{"role": "user", "content": "Where is the Eiffel Tower?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": True}})
    return [stop.choices[0].message.content, shaped.choices[0].message.content]


def streamed_steps(c, model: str) -> tuple[str, list[int]]:
    """A greedy reply streamed with logprobs and usage: its text, and the tokens each chunk
    carried (a step that accepted drafts sends them all in one chunk)."""
    text, per_chunk, usage, finish = "", [], None, None
    for chunk in c.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=24,
                                           stream=True, logprobs=True, top_logprobs=1,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.usage:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].logprobs:  # (a sampled end-of-text token has no text)
            text += chunk.choices[0].delta.content or ""
            per_chunk.append(len(chunk.choices[0].logprobs.content))
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and usage.completion_tokens == sum(per_chunk) == 24
    return text, per_chunk


def spec_trace(url: str, rid: str) -> dict:
    from serving import http_request

    body = json.dumps({"model": "SmolLM2-135M-Instruct", "messages": QUESTION, "temperature": 0,
                       "max_tokens": 24, "ignore_eos": True}).encode()
    assert http_request(url, "POST", "/v1/chat/completions", body, {"X-Request-Id": rid})[0] == 200
    status, _, raw = http_request(url, "GET", f"/debug/requests/{rid}")
    assert status == 200
    return json.loads(raw)["traces"][0]


# none adaptive: adaptive drafting starts a request from the engine's acceptance so far and the
# step cost it fitted, and may rightly draft nothing for the trace's request (a loaded host's fit);
# the test needs drafts to verify
NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "adaptive": False}
SPECULATING = {  # deployment → (config, its speculative_config): each connector with a method
    "colocated.yaml, ngram": ("colocated.yaml", NGRAM),
    "serve-tcp.yaml, suffix": ("serve-tcp.yaml", {"method": "suffix", "adaptive": False}),
    # shared_store: configs/serve.yaml as shipped (its connector), with NGRAM, in the test below
    # the default model as its own draft: always drafting (adaptive would see a draft pass costs a step)
    "serve-collective.yaml, draft_model": ("serve-collective.yaml", {"model": None, "adaptive": False}),
}


def test_greedy_identical_colocated_and_every_connector(serve_url, default_model_path):
    """And sampled with a seed: a seed gives the same replies wherever the first token is drawn.
    Also configs/serve.yaml as shipped (its shared_store connector; ITL_SLO_MS) with ngram
    speculation, placement by SLO on: the same replies wherever each prompt was computed, and a
    short prompt sent alone is prefilled on its decode replica (sooner than a trip through the
    pool), as its trace shows. Every deploy here holds a 128 MiB KV cache (`small_kv`).
    Each app gets its requests all at once, as clients send them. Every
    connector runs with speculative decoding on (a method each), and colocated with it too: the
    same replies as colocated without it. The default model as its own draft over the
    collective connector has every greedy draft accepted: its draft KV crossed with the prompt's."""
    outputs, sampled, landed, metrics, spec_traces, shaped, streamed = {}, {}, {}, {}, {}, {}, {}
    budget = "serve.yaml as shipped, placement by SLO, ngram"
    for name in ("colocated.yaml", budget, *SPECULATING):
        if name in SPECULATING:
            file, spec = SPECULATING[name]
            spec = {**spec, "model": str(default_model_path)} if "model" in spec else spec
            args = {**args_of(file), "speculative_config": spec}
        elif name == budget:
            args = {**shipped_args("serve.yaml"), "speculative_config": NGRAM, "itl_slo_ms": ITL_SLO_MS}
        else:
            args = args_of(name)
        deploy(small_kv(in_float32(args)))
        speculating = name != "colocated.yaml"
        c = client(serve_url)
        model = c.models.list().data[0].id
        # every request at once, as clients send them: one running batch, not one request at a time
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            asked = {"greedy": pool.submit(greedy, c, model), "shaped": pool.submit(stop_and_schema, c, model),
                     "sampled": pool.submit(seeded, c, model)}
            if name in ("colocated.yaml", "colocated.yaml, ngram"):  # several tokens in one chunk: the SDK reads it
                asked["streamed"] = pool.submit(streamed_steps, c, model)
            got = {k: f.result(timeout=600) for k, f in asked.items()}
        outputs[name], shaped[name], sampled[name] = got["greedy"], got["shaped"], got["sampled"]
        if "streamed" in got:
            streamed[name] = got["streamed"]
        if speculating:  # the request's trace counts its drafts; usage counts tokens as without. After
            # the others: suffix decoding drafts from the replies it has seen
            trace = spec_trace(serve_url, f"spec-{len(shaped)}")
            assert trace["spec_draft_tokens"] >= trace["spec_accepted_tokens"] > 0, (name, trace)
            assert trace["completion_tokens"] == 24
            spec_traces[name] = trace
        if name == budget:  # a short prompt sent alone, when the burst above is done
            placed = spec_trace(serve_url, "placed-by-slo")
        landed[name] = sum(s.get("kv_landed", 0) for s in replica_stats(serve_url))
        metrics[name] = scrape(serve_url)
    for name in (budget, *SPECULATING):
        assert outputs[name] == outputs["colocated.yaml"], name
        assert sampled[name] == sampled["colocated.yaml"], name
        assert shaped[name] == shaped["colocated.yaml"], name
        if name != budget:
            crossed = 0 if name == "colocated.yaml, ngram" else len(PROMPTS) + 5  # each prompt's KV
            assert landed[name] == crossed, name
    assert "Paris" in outputs["colocated.yaml"][0] and "Paris" not in shaped["colocated.yaml"][0]
    # speculation's accepted drafts reach the client in fuller chunks, the same text and logprobs
    assert streamed["colocated.yaml, ngram"][0] == streamed["colocated.yaml"][0]
    assert max(streamed["colocated.yaml, ngram"][1]) > 1
    assert json.loads(shaped["colocated.yaml"][1])["city"]
    # the decode replica timed its steps at start; the prompts it kept, it kept by SLO, the rest crossed
    assert total(metrics[budget], "tandem:step_seconds_per_token", pool="decode") > 0
    kept = total(metrics[budget], "tandem:local_prefills_total", pool="decode", reason="slo")
    assert kept >= 1 and kept + landed[budget] == len(PROMPTS) + 6  # with the one sent alone
    assert placed["placement"] == "local" and placed["kv"].startswith("slo: prefilled here"), placed
    assert placed["local_ttft_ms"] < placed["remote_ttft_ms"] and placed["local_itl_ms"] <= ITL_SLO_MS
    for name in (budget, *SPECULATING):  # drafts were verified, and vLLM's metrics say so
        assert total(metrics[name], "vllm:spec_decode_num_draft_tokens_total", pool="decode") > 0, name
        assert total(metrics[name], "vllm:spec_decode_num_accepted_tokens_total", pool="decode") > 0, name
        assert total(metrics[name], "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0, name
    draft = spec_traces["serve-collective.yaml, draft_model"]  # a greedy request's (sampled ones may reject)
    assert draft["spec_draft_tokens"] > 10
    assert draft["spec_accepted_tokens"] == draft["spec_draft_tokens"]
