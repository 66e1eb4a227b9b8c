"""The OpenAI layer over real engines, in one process (no Ray): colocated, and disaggregated
with the TCP connector over loopback. Shapes, limits, n, stop, streaming, cancellation, vLLM's
extras (structured output and tool calls: test_structured_output.py; logprobs:
test_openai_logprobs.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.router.errors import APIError
from openai_helpers import MODEL, chat, drain, run, settled


def test_greedy_disaggregated_equals_colocated_and_blocks_return(stack):
    async def go():
        a = await stack["disagg"].chat(chat(temperature=0, max_tokens=12))
        b = await stack["colocated"].chat(chat(temperature=0, max_tokens=12))
        return a, b, await stack["decode"].stats(), await stack["prefill"].stats()

    a, b, dstats, pstats = run(go())
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["usage"] == b["usage"] and a["usage"]["completion_tokens"] == 12
    assert a["choices"][0]["finish_reason"] == "length"
    assert dstats["kv_landed"] >= 1 and dstats["blocks_in_use"] == 0 and dstats["num_running"] == 0
    assert pstats["blocks_in_use"] == 0 and pstats["leases"] == 0


def test_stream_matches_non_stream_and_reports_usage(stack):
    async def go():
        full = await stack["disagg"].chat(chat(temperature=0, max_tokens=10))
        stream = await stack["disagg"].chat(chat(temperature=0, max_tokens=10, stream=True,
                                                 stream_options={"include_usage": True}))
        return full, await drain(stream)

    full, chunks = run(go())
    assert chunks[-1] == "[DONE]"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-3]["choices"][0]["finish_reason"] == "length"
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"] == full["usage"]


def test_n_samples_and_seed_reproducibility(stack):
    async def go():
        body = chat(temperature=1.0, n=2, seed=7, max_tokens=8)
        return await stack["disagg"].chat(body), await stack["disagg"].chat(body)

    a, b = run(go())
    assert [c["index"] for c in a["choices"]] == [0, 1]
    texts = [c["message"]["content"] for c in a["choices"]]
    assert texts == [c["message"]["content"] for c in b["choices"]]  # same seed, same samples
    assert texts[0] != texts[1]  # seed + j: the samples differ
    assert a["usage"]["completion_tokens"] == 16


def test_stop_string_ends_the_text(stack):
    async def go():
        free = await stack["disagg"].completions({"model": MODEL, "prompt": "Once upon", "temperature": 0,
                                                  "max_tokens": 12})
        text = free["choices"][0]["text"]
        stop = text[3:6]
        cut = await stack["disagg"].completions({"model": MODEL, "prompt": "Once upon", "temperature": 0,
                                                 "max_tokens": 12, "stop": [stop]})
        return text, stop, cut

    text, stop, cut = run(go())
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["choices"][0]["stop_reason"] == stop


@pytest.mark.parametrize("body,status,param", [
    (chat(model="nope"), 404, "model"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    (chat(temperature=-1), 400, "temperature"),
    (chat(top_p=0), 400, "top_p"),
    (chat(max_tokens=0), 400, "max_tokens"),
    (chat(max_tokens=5000), 400, "max_tokens"),
    (chat(n=100), 400, "n"),
    (chat(top_logprobs=3), 400, "top_logprobs"),
    (chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (chat(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),  # as in vLLM: not streamed
    (chat(prompt_logprobs=21), 400, "prompt_logprobs"),
    (chat(prompt_logprobs=-1), 400, "prompt_logprobs"),  # vLLM's "the whole vocabulary": refused
    (chat(priority=2**31), 400, "priority"),
    (chat(priority=0.5), 400, "priority"),
    (chat(cache_salt=""), 400, "cache_salt"),
    (chat(cache_salt="s" * 257), 400, "cache_salt"),
    (chat(cache_salt="\ud800nope"), 400, "cache_salt"),  # a lone surrogate: not text
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    ([1, 2], 400, None),
])
def test_bad_requests_get_openai_errors(stack, body, status, param):
    with pytest.raises(APIError) as info:
        run(stack["disagg"].chat(body))
    err = info.value
    assert err.status == status and err.body()["error"]["param"] == param
    assert "nope" not in err.body()["error"]["message"]  # the input is never echoed


def test_client_gone_mid_stream_frees_blocks(stack):
    async def go():
        stream = await stack["disagg"].chat(chat(temperature=0, max_tokens=200, ignore_eos=True, stream=True))
        got = 0
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()
        return await settled(stack)

    dstats, pstats = run(go())
    assert dstats["blocks_in_use"] == 0 and dstats["num_running"] == 0
    assert pstats["blocks_in_use"] == 0


def test_first_token_stays_first_when_the_event_loop_is_busy(stack):
    """The prefill side's first token reaches the stream ahead of the decode steps after it,
    even when other work holds the event loop while those steps run (Serve's replicas)."""
    body = chat(temperature=0, max_tokens=10)

    async def go(name: str, busy: bool) -> str:
        async def hog():
            while True:
                time.sleep(0.02)  # other streams, Serve's own work
                await asyncio.sleep(0)

        task = asyncio.ensure_future(hog()) if busy else None
        try:
            r = await asyncio.wait_for(stack[name].chat(body), 60)
        finally:
            if task is not None:
                task.cancel()
        return r["choices"][0]["message"]["content"]

    want = run(go("colocated", False))
    for _ in range(3):
        assert run(go("disagg", True)) == want


def test_a_completions_batch_is_each_prompt_alone_in_choice_order(stack):
    """prompt=[A, B] with n=2: choices 0-1 are A's samples, 2-3 B's, each what A or B alone
    gives with the same seed; usage counts both prompts once. Streamed the same."""
    prompts = ["Once upon a time", "The weather today"]
    common = {"model": MODEL, "temperature": 1.0, "seed": 3, "n": 2, "max_tokens": 6}

    async def go():
        alone = [await stack["disagg"].completions({**common, "prompt": p}) for p in prompts]
        batch = await stack["disagg"].completions({**common, "prompt": prompts})
        chunks = await drain(await stack["disagg"].completions({**common, "prompt": prompts, "stream": True,
                                                                "stream_options": {"include_usage": True}}))
        return alone, batch, chunks, await stack["decode"].stats()

    alone, batch, chunks, dstats = run(go())
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    want = [c["text"] for a in alone for c in a["choices"]]
    assert [c["text"] for c in batch["choices"]] == want
    assert want[0] != want[1] and want[:2] != want[2:]
    assert batch["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert batch["usage"]["completion_tokens"] == 4 * 6
    streamed = ["", "", "", ""]
    finished = set()
    for c in chunks[:-2]:
        for ch in c["choices"]:
            streamed[ch["index"]] += ch["text"]
            if ch["finish_reason"]:
                finished.add(ch["index"])
    assert streamed == want and finished == {0, 1, 2, 3}
    assert chunks[-2]["usage"] == batch["usage"]
    assert dstats["blocks_in_use"] == 0 and dstats["num_running"] == 0


def test_logit_bias_steers_the_first_token_in_both_pools(stack):
    """The first token is sampled on the prefill side when disaggregated: the bias must reach
    it there as well as every decode step."""
    body = {"model": MODEL, "prompt": "Once upon", "temperature": 0, "max_tokens": 4, "logprobs": 0}

    async def go(name: str, **extra) -> list[str]:
        r = await stack[name].completions({**body, **extra})
        return r["choices"][0]["logprobs"]["tokens"]

    async def all_of():
        free = await go("colocated")
        first = stack["disagg"].tokenizer.encode(free[0])[-1]
        forced = 1000 if first != 1000 else 1001
        piece = stack["disagg"].token_text(forced)
        out = {}
        for name in ("colocated", "disagg"):
            out[name] = (await go(name), await go(name, logit_bias={str(first): -100}),
                         await go(name, logit_bias={str(forced): 100}))
        return free, piece, out

    free, piece, out = run(all_of())
    for name, (unbiased, banned, forced) in out.items():
        assert unbiased == free, name
        assert banned[0] != free[0], name  # the greedy first token, banned
        assert forced == [piece] * 4, name  # +100: that token every time


@pytest.mark.parametrize("body,param", [
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),  # no schema
    (chat(response_format={"type": "yaml"}), "response_format"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),  # "auto": no parser
    (chat(functions=[{"name": "f"}]), "functions"),
    (chat(logit_bias={"5000000": 1}), "logit_bias"),
    (chat(logit_bias={"1": 100.5}), "logit_bias.1"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": MODEL, "prompt": "x", "best_of": 2}, "best_of"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"model": MODEL, "prompt": ["x", [1, 2]]}, "prompt"),
    ({"model": MODEL, "prompt": ["x"] * 33, "n": 2}, "prompt"),
])
def test_features_this_server_lacks_are_refused_by_name(stack, body, param):
    call = stack["disagg"].chat if "messages" in body else stack["disagg"].completions
    with pytest.raises(APIError) as info:
        run(call(body))
    assert info.value.status == 400 and info.value.body()["error"]["param"] == param


def test_continue_final_message_goes_on_with_the_assistants_words(stack):
    """vLLM's continue_final_message (with add_generation_prompt false): the prompt ends inside
    the last message and the reply continues it, as a completion of that same text would."""
    server = stack["colocated"]
    messages = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a"}]
    flags = {"continue_final_message": True, "add_generation_prompt": False}
    text = server.tokenizer.chat_prompt(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("assistant\nOnce upon a")

    async def go():
        return (await server.chat(chat(messages=messages, temperature=0, max_tokens=8, ignore_eos=True, **flags)),
                await server.completions({"model": MODEL, "prompt": server.tokenizer.hf.encode(text), "temperature": 0,
                                          "max_tokens": 8, "ignore_eos": True}))

    continued, same_text = run(go())
    assert continued["choices"][0]["message"]["content"] == same_text["choices"][0]["text"]
    counts = ("prompt_tokens", "completion_tokens")  # the same text again: more of it is cached
    assert [continued["usage"][k] for k in counts] == [same_text["usage"][k] for k in counts]
    for bad in ({"continue_final_message": True},  # add_generation_prompt is true unless said otherwise
                {**flags, "response_format": {"type": "json_object"}}):  # a reply held to JSON starts anew
        with pytest.raises(APIError) as info:
            run(server.chat(chat(messages=messages, **bad)))
        assert info.value.status == 400 and info.value.param == "continue_final_message"



def test_cache_salt_keeps_prefix_cache_hits_within_a_tenant(stack):
    """vLLM's cache_salt: a prompt sent again hits the prefix cache only under the same salt (or
    none), in the pool that prefills it: colocated, and the prefill pool when disaggregated."""
    prompt = "In a hole in the ground there lived a hobbit, salted. " * 5

    async def hits(name: str, pool: str, salt: str | None) -> int:
        before = (await stack[pool].stats())["prefix_cache_hits"]
        salted = {"cache_salt": salt} if salt else {}
        out = await stack[name].completions({"model": MODEL, "prompt": prompt, "max_tokens": 1, **salted})
        hit = (await stack[pool].stats())["prefix_cache_hits"] - before
        assert out["usage"]["prompt_tokens_details"] == {"cached_tokens": hit}  # what the client is told
        return hit

    async def go():
        return {name: [await hits(name, pool, s) for s in ("tenant-a", "tenant-a", "tenant-b", None, None)]
                for name, pool in (("colocated", "colocated_server"), ("disagg", "prefill"))}

    for name, (a, a_again, b, plain, plain_again) in run(go()).items():
        assert a == 0 and a_again > 0 and a_again == plain_again, name  # the whole cached prefix, each time
        assert b == 0 and plain == 0, name  # another tenant's prompt, or an unsalted one, starts cold


def test_usage_reports_the_prompt_tokens_a_prefix_cache_served(stack):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: a prompt sent again reports the whole
    blocks its pool found cached (the prefill pool's, when disaggregated), streamed or not, and
    once per prompt as prompt_tokens counts it, however many samples share the prompt."""
    prompt = "Far over the misty mountains cold, to dungeons deep and caverns old. " * 4
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}

    async def go(name: str, pool: str):
        server = stack[name]
        first = (await server.completions(body))["usage"]
        before = (await stack[pool].stats())["prefix_cache_hits"]
        two = (await server.completions({**body, "n": 2, "temperature": 1.0, "seed": 3}))["usage"]
        both_hits = (await stack[pool].stats())["prefix_cache_hits"] - before
        chunks = await drain(await server.completions({**body, "stream": True,
                                                       "stream_options": {"include_usage": True}}))
        return first, two, both_hits, chunks[-2]["usage"]

    for name, pool in (("colocated", "colocated_server"), ("disagg", "prefill")):
        first, two, both_hits, streamed = run(go(name, pool))
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}, name  # a prompt new to the pool
        cached = two["prompt_tokens_details"]["cached_tokens"]
        assert 0 < cached < two["prompt_tokens"] == first["prompt_tokens"] and cached % 16 == 0, name
        assert both_hits == 2 * cached, name  # each sample hit the cache; the prompt is counted once
        assert streamed == {**first, "prompt_tokens_details": {"cached_tokens": cached}}, name
