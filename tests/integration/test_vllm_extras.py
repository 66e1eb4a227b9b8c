"""vLLM's request extras through the OpenAI layer over real engines, in one process (no Ray):
what a client written against vLLM's server sends gets what vLLM gives, across the TCP hand-off
(the prefill replica samples the first token) and colocated alike."""

from __future__ import annotations

import pytest

from cluster.router.errors import APIError
from openai_helpers import MODEL, chat, drain, run


def texts(stack, body, names=("disagg", "colocated")):
    async def go():
        return [(await stack[name].chat(body))["choices"][0] for name in names]
    return run(go())


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(stack):
    free = texts(stack, chat(temperature=0, max_tokens=24))[0]["message"]["content"]
    stop = free[6:9]
    cut, kept = [texts(stack, chat(temperature=0, max_tokens=24, stop=[stop], include_stop_str_in_output=keep))
                 for keep in (False, True)]
    end = free.index(stop)
    for disagg, colocated in (cut, kept):
        assert disagg == colocated and disagg["finish_reason"] == "stop" and disagg["stop_reason"] == stop
    assert cut[0]["message"]["content"] == free[:end] and kept[0]["message"]["content"] == free[:end + len(stop)]
    chunks = streamed(stack, chat(temperature=0, max_tokens=24, stop=[stop], stream=True,
                                  include_stop_str_in_output=True))
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:-1]) == free[:end + len(stop)]


def streamed(stack, body):
    async def go():
        return await drain(await stack["disagg"].chat(body))
    return run(go())


def test_allowed_token_ids_hold_every_token_first_included(stack):
    hf = stack["disagg"].tokenizer.hf
    allowed = [hf.convert_tokens_to_ids(t) for t in ("a", "b", "c")]
    body = chat(temperature=1.0, seed=9, max_tokens=12, allowed_token_ids=allowed)
    disagg, colocated = texts(stack, body)
    assert disagg == colocated and disagg["message"]["content"]
    assert set(disagg["message"]["content"]) <= {"a", "b", "c"}


def test_bad_words_are_tokenized_as_vllm_does_and_never_generated(stack):
    server = stack["disagg"]
    hf = server.tokenizer.hf
    free = texts(stack, chat(temperature=0, max_tokens=12))[0]["message"]["content"]
    first = hf.decode(hf.encode(free, add_special_tokens=False)[:1]).strip()  # the reply's first word piece
    body = chat(temperature=0, max_tokens=12, bad_words=[first, " two words"])
    params = server.prepare("chat", body).params
    assert params.bad_words_token_ids == (tuple(hf.encode(first, add_special_tokens=False)),
                                          tuple(hf.encode(" " + first, add_special_tokens=False)),
                                          tuple(hf.encode("two words", add_special_tokens=False)),
                                          tuple(hf.encode(" two words", add_special_tokens=False)))
    disagg, colocated = texts(stack, body)
    assert disagg == colocated and disagg["message"]["content"] != free
    assert not disagg["message"]["content"].startswith(first)


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(stack):
    ids = list(range(100, 140))

    async def go(prompt, **kw):
        return await stack["disagg"].completions({"model": MODEL, "prompt": prompt, "max_tokens": 6,
                                                  "temperature": 0, **kw})

    cut = run(go(ids, truncate_prompt_tokens=8, echo=True))
    alone = run(go(ids[-8:]))
    assert cut["usage"]["prompt_tokens"] == 8 and alone["usage"]["prompt_tokens"] == 8
    echoed = stack["disagg"].tokenizer.hf.decode(ids[-8:])
    assert cut["choices"][0]["text"] == echoed + alone["choices"][0]["text"]
    assert run(go(ids, truncate_prompt_tokens=500))["usage"]["prompt_tokens"] == len(ids)


def test_continuous_usage_stats_put_the_counts_so_far_in_every_chunk(stack):
    body = chat(temperature=0, max_tokens=10, n=2, stream=True,
                stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = streamed(stack, body)[:-1]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] for c in chunks)
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 20 and chunks[-1]["choices"] == []
    plain = streamed(stack, {**body, "stream_options": {"include_usage": True}})[:-1]
    assert all(c["usage"] is None for c in plain[:-1]) and plain[-1]["usage"] == chunks[-1]["usage"]


@pytest.mark.parametrize("extra, param", [
    ({"use_beam_search": True}, "use_beam_search"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"allowed_token_ids": [10 ** 9]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids.0"),
    ({"bad_words": ["x" * 300]}, "bad_words.0"),
    ({"bad_words": ["a\x00"]}, "bad_words"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
])
def test_extras_out_of_range_are_a_400_naming_the_field(stack, extra, param):
    with pytest.raises(APIError) as info:
        run(stack["disagg"].chat(chat(max_tokens=4, **extra)))
    assert info.value.status == 400 and info.value.param == param

