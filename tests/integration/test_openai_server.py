"""The OpenAI layer over real engines, in one process (no Ray): colocated, and disaggregated
with the TCP connector over loopback. Shapes, limits, n, stop, streaming, cancellation."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from cluster.router.protocol import APIError

MODEL = "tiny"  # the served name of the `stack` fixture (tests/integration/conftest.py)


def run(coro):
    return asyncio.run(coro)


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], **kw}


async def drain(stream) -> list[dict]:
    out = []
    async for line in stream:
        assert line.startswith("data: ") and line.endswith("\n\n")
        payload = line[len("data: "):].strip()
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


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
        await asyncio.sleep(0.3)
        return await stack["decode"].stats(), await stack["prefill"].stats()

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
