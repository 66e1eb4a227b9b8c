"""tandem.proto's Generate over the OpenAI server, in one process (no Ray, no sockets): a gRPC
request gives the same tokens, usage and errors as the same request over the HTTP API, and a
stream that ends early (closed, or past its deadline) frees everything. The same RPC through
Serve's gRPC proxy with a grpcio client: tests/cluster/test_grpc.py."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import pytest

from cluster.router import grpc_api
from cluster.router import tandem_pb2 as pb
from cluster.router.openai_server import OpenAIServer
from cluster.router.errors import APIError
from openai_helpers import settled

MODEL = "tiny"  # the served name of the `stack` fixture (tests/integration/conftest.py)
QUESTION = "Say something."


def run(coro):
    return asyncio.run(coro)


def chat_request(**kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(model=MODEL, chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=QUESTION)]),
                              **kw)


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}], **kw}


async def collect(server: OpenAIServer, req: pb.GenerateRequest, timeout_s: float | None = None) -> list:
    return [m async for m in grpc_api.generate(server, req, timeout_s)]


def choices(messages: list) -> dict[int, dict]:
    """Per choice index: its text, token ids, logprobs and finish, joined from the messages."""
    out: dict[int, dict] = {}
    for m in messages[:-1]:
        c = out.setdefault(m.index, {"text": "", "ids": [], "logprobs": [], "finish": None, "stop": None})
        assert c["finish"] is None, "nothing follows a choice's finishing message"
        c["text"] += m.text
        c["ids"] += list(m.token_ids)
        c["logprobs"] += list(m.logprobs)
        c["finish"] = m.finish_reason or None
        c["stop"] = m.WhichOneof("stop_reason") and getattr(m, m.WhichOneof("stop_reason"))
    return out


def test_greedy_chat_streams_the_http_answer_with_usage(stack):
    async def go():
        return (await collect(stack["disagg"], chat_request(temperature=0, max_tokens=12)),
                await stack["disagg"].chat(chat_body(temperature=0, max_tokens=12)))

    messages, http = run(go())
    last = messages[-1]
    assert last.HasField("usage") and not last.text and not last.token_ids
    assert [m.HasField("usage") for m in messages].count(True) == 1
    assert len(messages) > 2  # streamed: the text came in pieces, not in one message
    (c,) = choices(messages).values()
    assert c["text"] == http["choices"][0]["message"]["content"] and c["finish"] == "length"
    assert len(c["ids"]) == 12
    u = http["usage"]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens) == \
        (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"])
    assert len({m.id for m in messages}) == 1 and messages[0].id.startswith("chatcmpl-")


def test_n_seed_logprobs_and_stop_mean_what_they_mean_over_http(stack):
    sampling = dict(n=2, temperature=0.9, seed=7, max_tokens=8, ignore_eos=True)

    async def go():
        g = await collect(stack["disagg"], chat_request(**sampling, logprobs=2))
        h = await stack["disagg"].chat(chat_body(**sampling, logprobs=True, top_logprobs=2))
        return g, h

    g, h = run(go())
    got = choices(g)
    assert sorted(got) == [0, 1]
    for j in (0, 1):
        want = h["choices"][j]
        assert got[j]["text"] == want["message"]["content"]
        lps = got[j]["logprobs"]
        assert len(lps) == len(got[j]["ids"]) == 8 and [e.token_id for e in lps] == got[j]["ids"]
        assert [e.token for e in lps] == [e["token"] for e in want["logprobs"]["content"]]
        assert [e.logprob for e in lps] == pytest.approx([e["logprob"] for e in want["logprobs"]["content"]])
        assert all(len(e.top) == 2 and e.top[0].logprob >= e.top[1].logprob for e in lps)
    assert got[0]["text"] != got[1]["text"]  # seed + j: two different samples

    # a stop string found in the greedy text ends it there, and the message says which one
    greedy = choices(run(collect(stack["disagg"], chat_request(temperature=0, max_tokens=12))))[0]["text"]
    stop = greedy.strip().split()[1]
    c = choices(run(collect(stack["disagg"], chat_request(temperature=0, max_tokens=12, stop=[stop]))))[0]
    assert (c["finish"], c["stop"]) == ("stop", stop) and stop not in c["text"]


def test_completion_prompts_text_and_token_ids(stack):
    server = stack["disagg"]
    ids = server.tokenizer.encode("The shelves hold")

    async def go():
        by_text = await collect(server, pb.GenerateRequest(model=MODEL, text="The shelves hold", temperature=0))
        by_ids = await collect(server, pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=ids),
                                                          temperature=0, ignore_eos=True))
        http = await server.completions({"model": MODEL, "prompt": "The shelves hold", "temperature": 0})
        return by_text, by_ids, http

    by_text, by_ids, http = run(go())
    assert by_text[-1].id.startswith("cmpl-")
    assert choices(by_text)[0]["text"] == http["choices"][0]["text"]
    assert by_text[-1].usage.completion_tokens == http["usage"]["completion_tokens"]
    assert by_ids[-1].usage.completion_tokens == 16  # the completions default, as over HTTP
    assert by_ids[-1].usage.prompt_tokens == len(ids)


def test_usage_counts_the_prompt_tokens_a_prefix_cache_served(stack):
    text = "Under the mountain the dragon sleeps on his hoard of gold and gems. " * 4
    server = stack["disagg"]

    async def go():
        first = await collect(server, pb.GenerateRequest(model=MODEL, text=text, max_tokens=2))
        again = await collect(server, pb.GenerateRequest(model=MODEL, text=text, max_tokens=2))
        http = await server.completions({"model": MODEL, "prompt": text, "max_tokens": 2})
        salted = [(await collect(server, pb.GenerateRequest(model=MODEL, text=text, max_tokens=2,
                                                            cache_salt="tenant-b")))[-1].usage for _ in range(2)]
        return first[-1].usage, again[-1].usage, http["usage"], salted

    first, again, http, salted = run(go())
    assert first.cached_tokens == 0  # new to the prefill pool
    assert 0 < again.cached_tokens == http["prompt_tokens_details"]["cached_tokens"] < again.prompt_tokens
    # another tenant's salt shares nothing with the unsalted blocks, then its own blocks only
    assert salted[0].cached_tokens == 0 and salted[1].cached_tokens == again.cached_tokens


def test_logit_bias_over_grpc_is_the_http_one(stack):
    server = stack["disagg"]
    free = server.tokenizer.encode("The shelves hold")

    async def go():
        plain = await collect(server, pb.GenerateRequest(model=MODEL, text="The shelves hold", temperature=0,
                                                         max_tokens=4))
        banned = choices(plain)[0]["ids"][0]
        forced = 1000 if banned != 1000 else 1001
        bias = {banned: -100.0, forced: 100.0}
        over_grpc = await collect(server, pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=free),
                                                             temperature=0, max_tokens=4, logit_bias=bias))
        over_http = await server.completions({"model": MODEL, "prompt": free, "temperature": 0, "max_tokens": 4,
                                              "logit_bias": {str(t): b for t, b in bias.items()}})
        return forced, over_grpc, over_http

    forced, over_grpc, over_http = run(go())
    assert choices(over_grpc)[0]["ids"] == [forced] * 4
    assert choices(over_grpc)[0]["text"] == over_http["choices"][0]["text"]


def test_json_mode_over_grpc_is_the_http_one_for_chat_and_text_prompts(stack):
    server = stack["disagg"]
    json_mode = {"response_format": {"type": "json_object"}}

    async def go():
        chat = (await collect(server, chat_request(temperature=0, max_tokens=12, json_object=True)),
                await server.chat(chat_body(temperature=0, max_tokens=12, **json_mode)))
        text = (await collect(server, pb.GenerateRequest(model=MODEL, text="The shelves hold", temperature=0,
                                                         max_tokens=12, json_object=True)),
                await server.completions({"model": MODEL, "prompt": "The shelves hold", "temperature": 0,
                                          "max_tokens": 12, **json_mode}))
        return chat, text

    (chat_grpc, chat_http), (text_grpc, text_http) = run(go())
    assert choices(chat_grpc)[0]["text"] == chat_http["choices"][0]["message"]["content"]
    assert choices(text_grpc)[0]["text"] == text_http["choices"][0]["text"]
    assert chat_http["choices"][0]["message"]["content"].startswith("{")
    assert text_http["choices"][0]["text"].startswith("{")


def test_json_schema_over_grpc_is_the_http_one_and_bad_schemas_are_invalid_arguments(stack):
    server = stack["disagg"]
    schema = {"type": "object", "additionalProperties": False, "required": ["ok"],
              "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M"]}}}
    over_http = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}

    async def go():
        return (await collect(server, chat_request(temperature=0, max_tokens=160, json_schema=json.dumps(schema))),
                await server.chat(chat_body(temperature=0, max_tokens=160, response_format=over_http)))

    over_grpc, http = run(go())
    assert choices(over_grpc)[0]["text"] == http["choices"][0]["message"]["content"]
    assert json.loads(http["choices"][0]["message"]["content"])["ok"] in (True, False)

    for bad, says in [(dict(json_schema="{not json"), "JSON text"),
                      (dict(json_schema='{"a":' * 100_000), "JSON text"),  # too deep for the parser
                      (dict(json_schema='{"type": "object", "not": {}}'), "'not' is not supported"),
                      (dict(json_schema='{"type": "object"}', json_object=True), "exclude each other")]:
        with pytest.raises(APIError) as info:
            run(collect(server, chat_request(max_tokens=4, **bad)))
        assert grpc_api.status_code(info.value) == grpc.StatusCode.INVALID_ARGUMENT and says in info.value.message


def test_regex_choice_and_grammar_over_grpc_are_the_http_structured_outputs(stack):
    server = stack["disagg"]
    pattern, options = r"[a-z]{3}[0-9]+", ["one", "two (2)"]
    grammar, same = 'root ::= ("on" | "off") " " [0-9]{1,2}', r"(on|off) [0-9]{1,2}"  # the grammar as a regex

    async def go():
        return [(choices(await collect(server, chat_request(temperature=0, max_tokens=12, **grpc_kw)))[0]["text"],
                 (await server.chat(chat_body(temperature=0, max_tokens=12, structured_outputs=http)))
                 ["choices"][0]["message"]["content"])
                for grpc_kw, http in [({"regex": pattern}, {"regex": pattern}),
                                      ({"choice": options}, {"choice": options}),
                                      ({"grammar": grammar}, {"grammar": grammar})]]

    (regex_grpc, regex_http), (choice_grpc, choice_http), (grammar_grpc, grammar_http) = run(go())
    assert regex_grpc == regex_http and re.fullmatch(pattern, regex_grpc)
    assert choice_grpc == choice_http and choice_grpc in options
    assert grammar_grpc == grammar_http and re.fullmatch(same, grammar_grpc)
    for bad, says in [(dict(regex="a", choice=["b"]), "exactly one of"), (dict(regex="(?=a)"), "lookaround"),
                      (dict(regex="a", json_object=True), "exclude each other")]:
        with pytest.raises(APIError) as info:
            run(collect(server, chat_request(max_tokens=4, **bad)))
        assert grpc_api.status_code(info.value) == grpc.StatusCode.INVALID_ARGUMENT and says in info.value.message


def test_vllm_extras_over_grpc_are_the_http_ones(stack):
    server = stack["disagg"]
    hf = server.tokenizer.hf
    extras = {"include_stop_str_in_output": True, "allowed_token_ids": [hf.convert_tokens_to_ids(t) for t in "abc"],
              "bad_words": ["b"], "truncate_prompt_tokens": 6}
    kind, body = grpc_api.request_body(chat_request(max_tokens=8, stop=["ca"], **extras))
    assert kind == "chat" and body == chat_body(max_tokens=8, stop=["ca"], **extras)

    async def go():
        return (choices(await collect(server, chat_request(temperature=0, max_tokens=8, stop=["ca"], **extras)))[0],
                (await server.chat(chat_body(temperature=0, max_tokens=8, stop=["ca"], **extras)))["choices"][0])

    over_grpc, http = run(go())
    assert over_grpc["text"] == http["message"]["content"] and set(over_grpc["text"]) <= {"a", "c"}


@pytest.mark.parametrize("req, body, kind, code", [
    (chat_request(logit_bias={-1: 1.0}), chat_body(logit_bias={"-1": 1.0}), "chat", grpc.StatusCode.INVALID_ARGUMENT),
    (chat_request(temperature=3.0), chat_body(temperature=3.0), "chat", grpc.StatusCode.INVALID_ARGUMENT),
    (chat_request(temperature=float("nan")), chat_body(temperature=float("nan")), "chat",
     grpc.StatusCode.INVALID_ARGUMENT),
    (chat_request(n=100), chat_body(n=100), "chat", grpc.StatusCode.INVALID_ARGUMENT),
    (chat_request(max_tokens=0), chat_body(max_tokens=0), "chat", grpc.StatusCode.INVALID_ARGUMENT),
    (chat_request(max_tokens=5000), chat_body(max_tokens=5000), "chat", grpc.StatusCode.INVALID_ARGUMENT),
    (chat_request(seed=-1), chat_body(seed=-1), "chat", grpc.StatusCode.INVALID_ARGUMENT),
    (chat_request(logprobs=21), chat_body(logprobs=True, top_logprobs=21), "chat", grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(model=MODEL, chat=pb.Chat(messages=[pb.ChatMessage(role="wizard", content="x")])),
     {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "chat", grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(model=MODEL, chat=pb.Chat()), {"model": MODEL, "messages": []}, "chat",
     grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(model=MODEL, text="a\x00b"), {"model": MODEL, "prompt": "a\x00b"}, "text",
     grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(model=MODEL, token_ids=pb.TokenIds(ids=[1, 10**9])), {"model": MODEL, "prompt": [1, 10**9]},
     "text", grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(model="gpt-4", text="hi"), {"model": "gpt-4", "prompt": "hi"}, "text",
     grpc.StatusCode.NOT_FOUND),
    (chat_request(priority=1), chat_body(priority=1), "chat", grpc.StatusCode.INVALID_ARGUMENT),  # first-come policy
    (chat_request(cache_salt=""), chat_body(cache_salt=""), "chat", grpc.StatusCode.INVALID_ARGUMENT),
    (chat_request(chat_template_kwargs="[1]"), chat_body(chat_template_kwargs=[1]), "chat",
     grpc.StatusCode.INVALID_ARGUMENT),
    (chat_request(chat_template_kwargs='{"messages": []}'), chat_body(chat_template_kwargs={"messages": []}), "chat",
     grpc.StatusCode.INVALID_ARGUMENT),
])
def test_bad_requests_get_the_http_message_with_a_grpc_code(stack, req, body, kind, code):
    server = stack["disagg"]
    with pytest.raises(APIError) as over_grpc:
        run(collect(server, req))
    with pytest.raises(APIError) as over_http:
        run(server.chat(body) if kind == "chat" else server.completions(body))
    assert over_grpc.value.body() == over_http.value.body()
    assert grpc_api.status_code(over_grpc.value) == code


def test_continue_final_message_over_grpc_is_the_http_one(stack):
    server = stack["disagg"]
    messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Here is one:"}]
    chat = pb.Chat(messages=[pb.ChatMessage(**m) for m in messages])
    opts = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}

    async def go():
        go_on = await collect(server, pb.GenerateRequest(model=MODEL, chat=chat, add_generation_prompt=False,
                                                         continue_final_message=True, **opts))
        http = await server.chat({"model": MODEL, "messages": messages, "add_generation_prompt": False,
                                  "continue_final_message": True, **opts})
        new_turn = await collect(server, pb.GenerateRequest(model=MODEL, chat=chat, **opts))
        return go_on, http, new_turn

    go_on, http, new_turn = run(go())
    assert choices(go_on)[0]["text"] == http["choices"][0]["message"]["content"]
    assert go_on[-1].usage.prompt_tokens == http["usage"]["prompt_tokens"] < new_turn[-1].usage.prompt_tokens


@pytest.mark.parametrize("field, value, says", [
    ("chat_template_kwargs", "{not json", "chat_template_kwargs must be a JSON object as text"),
    ("add_generation_prompt", False, "add_generation_prompt is for chat prompts"),
    ("continue_final_message", True, "continue_final_message is for chat prompts"),
])
def test_grpc_only_shapes_of_the_chat_fields_are_invalid_arguments(stack, field, value, says):
    req = chat_request(**{field: value}) if field == "chat_template_kwargs" else \
        pb.GenerateRequest(model=MODEL, text="hi", **{field: value})
    with pytest.raises(APIError) as info:
        run(collect(stack["disagg"], req))
    assert grpc_api.status_code(info.value) == grpc.StatusCode.INVALID_ARGUMENT and info.value.message == says


def test_a_request_without_a_prompt_or_over_the_size_limit_is_refused(stack):
    with pytest.raises(APIError) as info:
        run(collect(stack["disagg"], pb.GenerateRequest(model=MODEL, temperature=0)))
    assert info.value.status == 400 and info.value.param == "prompt"

    async def too_big():
        return [m async for m in grpc_api.generate(stack["disagg"], pb.GenerateRequest(model=MODEL, text="x" * 2048),
                                                   None, max_bytes=1024)]

    with pytest.raises(APIError) as info:
        run(too_big())
    assert info.value.message == "the request exceeds 1024 bytes"
    assert grpc_api.status_code(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_stream_closed_early_or_past_its_deadline_frees_everything(stack):
    long = dict(temperature=0, max_tokens=400, ignore_eos=True)

    async def closed_early():
        stream = grpc_api.generate(stack["disagg"], chat_request(**long), None)
        got = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()  # what Serve does when the client cancels
        return got, await settled(stack)

    got, (d, p) = run(closed_early())
    assert len(got) == 3 and not any(m.finish_reason for m in got)
    assert d["blocks_in_use"] == 0 and d["num_running"] == 0 and p["blocks_in_use"] == 0

    async def past_deadline():
        with pytest.raises(APIError) as info:
            await collect(stack["disagg"], chat_request(**long), timeout_s=0.3)
        return info.value, await settled(stack)

    err, (d, p) = run(past_deadline())
    assert err.status == 408 and grpc_api.status_code(err) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert d["blocks_in_use"] == 0 and d["num_running"] == 0 and p["blocks_in_use"] == 0
