"""Structured output through the OpenAI layer over real engines, in one process (no Ray): JSON
mode, json_schema and tool calls, across the TCP hand-off and colocated, streamed or not."""

from __future__ import annotations

import json

import pytest

from cluster.router.errors import APIError
from openai_helpers import MODEL, chat, drain, run


def test_json_mode_across_the_hand_off_equals_colocated_and_opens_an_object(stack):
    body = chat(temperature=0, max_tokens=16, response_format={"type": "json_object"})

    async def go():
        return [await stack[name].chat(b) for name in ("disagg", "colocated")
                for b in (body, {**body, "response_format": None})]

    texts = [r["choices"][0]["message"]["content"] for r in run(go())]
    disagg, disagg_plain, colocated, colocated_plain = texts
    assert disagg == colocated and disagg_plain == colocated_plain
    assert disagg.startswith("{") and not disagg_plain.startswith("{")


def test_json_schema_across_the_hand_off_equals_colocated_and_is_a_value_of_the_schema(stack):
    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "size", "n"],
              "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["S", "M", "L"]}, "n": {"type": "integer"},
                             "tags": {"type": "array", "items": {"type": "null"}, "maxItems": 2}}}
    body = chat(temperature=0, max_tokens=120, response_format={
        "type": "json_schema", "json_schema": {"name": "shape", "schema": schema, "strict": True}})

    async def go():
        return [await stack[name].chat(body) for name in ("disagg", "colocated")]

    disagg, colocated = [r["choices"][0] for r in run(go())]
    assert disagg["message"]["content"] == colocated["message"]["content"]
    # the tiny random model, held to the schema; the reply ends where the value does
    jsonschema.validate(json.loads(disagg["message"]["content"]), schema)
    assert disagg["finish_reason"] == "stop" and disagg["message"]["content"].endswith("}")

    # a keyword xgrammar would silently not enforce is refused by name (pattern is enforced now:
    # test_json_schema_pattern_minimum_and_format_hold_every_reply)
    refused = {**body, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {
        "type": "object", "properties": {"s": {"type": "array", "uniqueItems": True}}}}}}
    with pytest.raises(APIError) as info:
        run(stack["disagg"].chat(refused))
    assert info.value.status == 400 and "'uniqueItems' is not supported" in info.value.message


def test_tools_with_tool_choice_none_and_text_response_format_are_plain_requests(stack):
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = run(stack["disagg"].chat(chat(temperature=0, max_tokens=4, tools=tools, tool_choice="none",
                                      response_format={"type": "text"})))
    assert r["choices"][0]["finish_reason"] == "length"


F_PARAMS = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["n", "ok"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": F_PARAMS}},
         {"type": "function", "function": {"name": "g"}}]


def test_a_named_tool_call_across_the_hand_off_equals_colocated_streamed_or_not(stack):
    import jsonschema

    body = chat(temperature=0, max_tokens=200, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "f"}})

    async def go():
        whole = [(await stack[name].chat(body))["choices"][0] for name in ("disagg", "colocated")]
        return whole, await drain(await stack["disagg"].chat({**body, "stream": True}))

    (disagg, colocated), chunks = run(go())
    [call] = disagg["message"]["tool_calls"]
    assert disagg["message"]["content"] is None and disagg["finish_reason"] == "stop"
    assert call["function"]["name"] == "f" and call["function"] == colocated["message"]["tool_calls"][0]["function"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), F_PARAMS)
    deltas = [tc for c in chunks[1:-1] for tc in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["id"].startswith("call_") and deltas[0]["function"]["name"] == "f"
    streamed = "".join(d["function"]["arguments"] for d in deltas)
    jsonschema.validate(json.loads(streamed), F_PARAMS)
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"


def test_required_tool_calls_are_calls_of_the_given_tools_in_every_choice(stack):
    import jsonschema

    body = chat(temperature=1.0, seed=5, n=2, max_tokens=200, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False)

    async def go():
        return await stack["disagg"].chat(body), await drain(await stack["disagg"].chat({**body, "stream": True}))

    whole, chunks = run(go())
    streamed: dict[int, list] = {0: [], 1: []}
    for c in chunks[1:-1]:
        streamed[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("tool_calls", [])
    for choice in whole["choices"]:
        for call in [tc["function"] for tc in choice["message"]["tool_calls"]] + [
                tc["function"] for tc in streamed[choice["index"]]]:
            jsonschema.validate(json.loads(call["arguments"]), F_PARAMS if call["name"] == "f" else {
                "type": "object", "additionalProperties": False})
        assert len(choice["message"]["tool_calls"]) == len(streamed[choice["index"]]) == 1
        assert choice["finish_reason"] == "tool_calls"
    with pytest.raises(APIError) as info:  # a reply held to calls cannot also be held to a format
        run(stack["disagg"].chat({**body, "response_format": {"type": "json_object"}}))
    assert info.value.param == "response_format"


def test_a_template_that_writes_tools_gets_them_and_earlier_calls_as_objects(tiny_model_paths):
    """What reaches a tool-aware chat template (Llama 3.1's and Hermes' read tools and
    tool_calls the same way): the request's tools, and earlier calls' arguments as objects."""
    from cluster.engine.tokenizer import Tokenizer
    from cluster.router.openai_server import OpenAIServer

    tok = Tokenizer(str(tiny_model_paths["llama"]))
    tok.hf.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }} {{ t.function.parameters | tojson }}|{% endfor %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }} {{ c.function.arguments.n }}{% endfor %}"
        "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}|{% endfor %}")
    assert tok.template_takes_tools
    server = OpenAIServer(MODEL, tok, 1024, generate=None)  # prepare only: nothing is generated
    history = [{"role": "user", "content": "n?"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                     "function": {"name": "f", "arguments": '{"n": 7, "ok": true}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    p = server.prepare("chat", chat(messages=history, tools=TOOLS, tool_choice="required"))
    prompt = tok.decode(p.children[0].prompt_ids)
    assert prompt.startswith(f"TOOL f {json.dumps(F_PARAMS)}|TOOL g ")
    assert prompt.endswith("|user: n?|assistant:  CALL f 7|tool: done FOR c1|") and "You can call" not in prompt
    assert p.params.structured.kind == "json_schema" and json.loads(p.params.structured.spec)["type"] == "array"


def test_regex_and_choice_across_the_hand_off_equal_colocated_and_match_streamed_or_not(stack):
    import re

    pattern = r"[0-9]{3}-[a-z]{2,4}( ok)?"
    options = ["red", "green (light)", "1+1"]
    bodies = [chat(temperature=0, max_tokens=24, structured_outputs={"regex": pattern}),
              chat(temperature=0, max_tokens=24, structured_outputs={"choice": options}),
              chat(temperature=0, max_tokens=24, guided_choice=options)]  # vLLM's name before 0.12
    sampled = chat(temperature=1.0, seed=3, n=3, max_tokens=24, structured_outputs={"choice": options})

    async def go():
        whole = [[(await stack[name].chat(b))["choices"][0] for name in ("disagg", "colocated")] for b in bodies]
        chunks = await drain(await stack["disagg"].chat({**bodies[0], "stream": True}))
        return whole, chunks, await stack["disagg"].chat(sampled)

    whole, chunks, many = run(go())
    for (disagg, colocated), ok in zip(whole, [lambda t: re.fullmatch(pattern, t), options.__contains__,
                                                options.__contains__]):
        text = disagg["message"]["content"]
        assert text == colocated["message"]["content"] and ok(text), text
    assert whole[1][0]["message"]["content"] == whole[2][0]["message"]["content"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[1:-1]) == whole[0][0]["message"]["content"]
    for choice in many["choices"]:  # the tiny random model, sampling: still one of the options, ended there
        assert choice["message"]["content"] in options and choice["finish_reason"] == "stop"


@pytest.mark.parametrize("extra, param, says", [
    ({"structured_outputs": {"json_object": True, "whitespace_pattern": " "}}, "structured_outputs",
     "whitespace_pattern is not supported"),
    ({"structured_outputs": {"regex": r"(a)\1"}}, "structured_outputs", "backreferences are not supported"),
    ({"structured_outputs": {"regex": "[ab"}}, "structured_outputs", "does not parse: unterminated character set"),
    ({"structured_outputs": {"json": {"type": "object", "properties": {"a": {"not": {}}}}}}, "structured_outputs",
     "'not' is not supported"),
    ({"structured_outputs": {"json": {"type": "string", "format": "binary"}}}, "structured_outputs",
     "format 'binary' is not supported"),
    ({"guided_grammar": 7}, "guided_grammar", "valid string"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1 item"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "string"}}}},
     "response_format", "root must be an object"),  # OpenAI's rule; structured_outputs.json takes any root
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "guided_regex", "exclude each other"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "exclude each other"),
    ({"structured_outputs": {"choice": ["a"]}, "tools": TOOLS, "tool_choice": "required"}, "response_format",
     "exclude each other"),
])
def test_structured_outputs_it_cannot_honour_are_a_400_naming_the_field(stack, extra, param, says):
    with pytest.raises(APIError) as info:
        run(stack["disagg"].chat(chat(max_tokens=4, **extra)))
    assert info.value.status == 400 and info.value.param == param and says in info.value.message


def test_structured_outputs_json_is_a_json_schema_and_json_object_json_mode(stack):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}

    async def go():
        return [(await stack["disagg"].chat(chat(temperature=0, max_tokens=40, **extra)))["choices"][0]["message"]["content"]
                for extra in ({"structured_outputs": {"json": schema}},
                              {"structured_outputs": {"json": json.dumps(schema)}},
                              {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
                              {"structured_outputs": {"json_object": True}},
                              {"response_format": {"type": "json_object"}})]

    as_schema, as_text, as_format, as_object, as_object_format = run(go())
    assert as_schema == as_text == as_format and isinstance(json.loads(as_schema)["ok"], bool)
    assert as_object == as_object_format and as_object.startswith("{")


def test_json_schema_pattern_minimum_and_format_hold_every_reply(stack):
    """Keywords the hand-written recognizer refused, now enforced: every reply, greedy or sampled,
    across the hand-off or colocated, is a value of the schema (checked by jsonschema and re)."""
    import re

    import jsonschema

    schema = {"type": "object", "additionalProperties": False, "required": ["code", "n", "x", "day"],
              "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                             "n": {"type": "integer", "minimum": 100, "maximum": 120},
                             "x": {"type": "number", "exclusiveMinimum": 0.5, "maximum": 2},
                             "day": {"type": "string", "format": "date"}}}
    greedy = chat(temperature=0, max_tokens=120, structured_outputs={"json": schema})
    sampled = chat(temperature=1.0, seed=11, n=3, max_tokens=120,
                   response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})

    async def go():
        return ([(await stack[name].chat(greedy))["choices"][0] for name in ("disagg", "colocated")],
                (await stack["disagg"].chat(sampled))["choices"])

    (disagg, colocated), many = run(go())
    assert disagg["message"]["content"] == colocated["message"]["content"]
    for choice in [disagg, *many]:
        value = json.loads(choice["message"]["content"])
        jsonschema.validate(value, schema)
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", value["day"]) and choice["finish_reason"] == "stop"


def test_an_ebnf_grammar_holds_the_reply_across_the_hand_off_and_a_bad_one_is_refused(stack):
    import re

    grammar = 'root ::= ("yes" | "no") ", " [0-9]{1,3} ("!" | "")'
    same = r"(yes|no), [0-9]{1,3}!?"  # the grammar's language, as a Python regex
    bodies = [chat(temperature=0, max_tokens=24, structured_outputs={"grammar": grammar}),
              chat(temperature=1.0, seed=2, n=3, max_tokens=24, guided_grammar=grammar)]

    async def go():
        return ([(await stack[name].chat(bodies[0]))["choices"][0] for name in ("disagg", "colocated")],
                (await stack["disagg"].chat(bodies[1]))["choices"])

    (disagg, colocated), many = run(go())
    assert disagg["message"]["content"] == colocated["message"]["content"]
    for choice in [disagg, *many]:
        assert re.fullmatch(same, choice["message"]["content"]), choice["message"]["content"]
    with pytest.raises(ValueError, match="the grammar does not compile: .*not defined"):  # the engine's: a 400 over HTTP
        run(stack["disagg"].chat(chat(max_tokens=4, structured_outputs={"grammar": "root ::= undefined_rule"})))


def test_a_structural_tag_holds_only_the_tagged_part(stack):
    import jsonschema

    inner = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "const_string", "value": "Answer: "},
        {"type": "tag", "begin": "<n>", "content": {"type": "json_schema", "json_schema": inner, "max_whitespace_cnt": 1},
         "end": "</n>"}]}}
    body = chat(temperature=0, max_tokens=40, structured_outputs={"structural_tag": tag})
    text = run(stack["disagg"].chat(body))["choices"][0]["message"]["content"]
    assert text.startswith("Answer: <n>") and text.endswith("</n>"), text
    jsonschema.validate(json.loads(text[len("Answer: <n>"):-len("</n>")]), inner)
