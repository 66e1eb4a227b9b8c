"""Several tokens of a stream in one SSE chunk (issue 32): what the router has of a stream when it
looks goes out at once, text, logprobs, finish_reason and usage right, and the openai SDK's
types read it; a token that has arrived is never held back for a fuller chunk."""

from __future__ import annotations

import asyncio
import json

import pytest

from cluster.engine.outputs import Logprob, TokenDelta, TokenLogprobs
from cluster.router.openai_server import OpenAIServer
from cluster.router.streams import merge_samples


def entry(token_id: int, logprob: float = -0.25) -> TokenLogprobs:
    return TokenLogprobs(Logprob(token_id, logprob), [Logprob(token_id, logprob)], 1)


async def fed(queue: asyncio.Queue):
    """A child stream whose items (lists of deltas, or an error to raise) the test puts in."""
    while (item := await queue.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield item


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_what_arrived_while_the_reader_was_busy_goes_out_as_one_delta_and_nothing_waits():
    async def go():
        q: asyncio.Queue = asyncio.Queue()
        merged = merge_samples([fed(q)])
        q.put_nowait([TokenDelta("Hel", [10], [entry(10)], num_cached_tokens=16)])
        first = await merged.__anext__()  # alone: nothing waits for company
        for item in ([TokenDelta("lo", [11], [entry(11)])],
                     [TokenDelta(",", [12], [entry(12)]), TokenDelta(" you", [13], [entry(13)], "length", None)]):
            q.put_nowait(item)
        await settle()  # all three arrived before the reader looked again
        second = await merged.__anext__()
        q.put_nowait(None)
        with pytest.raises(StopAsyncIteration):
            await merged.__anext__()
        return first, second

    (j1, a), (j2, b) = asyncio.run(go())
    assert (j1, a.text, a.token_ids, a.num_cached_tokens) == (0, "Hel", [10], 16)
    assert (j2, b.text, b.token_ids, b.finish_reason) == (0, "lo, you", [11, 12, 13], "length")
    assert [e.sampled.token_id for e in b.logprobs] == [11, 12, 13]


def test_tokens_that_arrived_before_an_error_go_out_before_it():
    async def go():
        q: asyncio.Queue = asyncio.Queue()
        merged = merge_samples([fed(q)])
        q.put_nowait([TokenDelta("a", [1])])
        q.put_nowait([TokenDelta("b", [2])])
        q.put_nowait(RuntimeError("replica lost"))
        await settle()
        got = await merged.__anext__()
        with pytest.raises(RuntimeError, match="replica lost"):
            await merged.__anext__()
        return got

    j, d = asyncio.run(go())
    assert (j, d.text, d.token_ids) == (0, "ab", [1, 2])


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from cluster.engine.tokenizer import Tokenizer

    return Tokenizer(default_model_path)


def server_with_one_item(tokenizer, texts: list[str]) -> tuple[OpenAIServer, list[int]]:
    """A server whose pool sends every token of the reply in one item (as a decode replica does
    for a consumer that fell behind, or a speculative step that accepted drafts)."""
    ids = [tokenizer.hf.encode(t, add_special_tokens=False)[0] for t in texts]

    async def generate(request_id, prompt_ids, params):
        yield [TokenDelta(t, [i], [entry(i, -0.5 - k)] if params.logprobs is not None else None,
                          "length" if k == len(ids) - 1 else None, num_prompt_tokens=len(prompt_ids))
               for k, (t, i) in enumerate(zip(texts, ids))]

    return OpenAIServer("m", tokenizer, 2048, generate), ids


def collect(started) -> list:
    """The SSE events of a streamed reply (`started`: server.chat(...) or .completions(...))."""
    async def go() -> list:
        out = []
        async for line in await started:
            assert line.startswith("data: ") and line.endswith("\n\n")
            body = line[6:].strip()
            out.append(body if body == "[DONE]" else json.loads(body))
        return out

    return asyncio.run(go())


def test_a_chat_chunk_carries_every_token_it_got_and_the_sdk_reads_it(tokenizer):
    from openai.types.chat import ChatCompletionChunk

    texts = [" Paris", " is", " nice"]
    server, ids = server_with_one_item(tokenizer, texts)
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True,
            "logprobs": True, "top_logprobs": 1, "stream_options": {"include_usage": True}}
    chunks = collect(server.chat(body))
    assert chunks[-1] == "[DONE]"
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks[:-1]]
    role, content, usage = parsed
    assert role.choices[0].delta.role == "assistant"
    choice = content.choices[0]
    assert choice.delta.content == " Paris is nice" and choice.finish_reason == "length"
    assert [e.token for e in choice.logprobs.content] == texts
    assert [e.logprob for e in choice.logprobs.content] == [-0.5, -1.5, -2.5]
    assert usage.choices == [] and usage.usage.completion_tokens == 3
    assert usage.usage.total_tokens == usage.usage.prompt_tokens + 3


def test_a_completions_chunk_carries_every_token_with_its_offsets(tokenizer):
    from openai.types import Completion

    texts = [" Paris", " is", " nice"]
    server, _ = server_with_one_item(tokenizer, texts)
    body = {"model": "m", "prompt": "The capital", "max_tokens": 3, "stream": True, "logprobs": 1,
            "stream_options": {"include_usage": True}}
    chunks = collect(server.completions(body))
    content, usage = [Completion.model_validate(c) for c in chunks[:-1]]
    choice = content.choices[0]
    assert choice.text == " Paris is nice" and choice.finish_reason == "length"
    assert choice.logprobs.tokens == texts and choice.logprobs.text_offset == [0, 6, 9]
    assert usage.usage.completion_tokens == 3
