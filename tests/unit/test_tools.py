"""Tool calling's plan (cluster/router/tools.py): what tools and tool_choice are refused, the
JSON a reply with calls is held to, how that reply becomes tool_calls (whole or streamed), and
how a conversation with earlier calls reaches the chat template."""

from __future__ import annotations

import json

import jsonschema
import pytest

from cluster.router.errors import APIError
from cluster.router.tools import CallStream, messages, plan

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}}
TREE = {"type": "function", "function": {"name": "plant", "parameters": {  # $refs of its own, "#" too
    "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}, "again": {"$ref": "#"}},
    "required": ["root"], "additionalProperties": False,
    "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                                                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                       "required": ["v"], "additionalProperties": False}}}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: an empty object
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def takes(p, text: str) -> bool:
    """Whether `text` is a value of the schema the plan holds the reply to (read by jsonschema;
    the engine's grammar of it: tests/integration/test_structured_output.py)."""
    assert p.schema.kind == "json_schema"
    return jsonschema.Draft202012Validator(json.loads(p.schema.spec)).is_valid(json.loads(text))


@pytest.mark.parametrize("tools,choice,param,says", [
    ([WEATHER], None, "tool_choice", '"auto"'),  # OpenAI's default with tools
    ([WEATHER], "auto", "tool_choice", "parser"),
    ([WEATHER], {"type": "function", "function": {"name": "get_time"}}, "tool_choice", "not among the tools"),
    ([WEATHER], {"function": {"name": "get_weather"}}, "tool_choice", "must be"),
    ([WEATHER], "sometimes", "tool_choice", "must be"),
    ([WEATHER], {"type": "function", "function": "get_weather"}, "tool_choice", "must be"),
    (None, "required", "tool_choice", "needs tools"),
    ([WEATHER, WEATHER], "required", "tools", "tools[1] has the name of an earlier tool"),
    ([{"type": "retrieval"}], "required", "tools", "tools[0]"),
    ([{"type": "function", "function": {"name": "bad name"}}], "required", "tools", "name"),
    ([NOW, {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "required", "tools",
     "tools[1].function.parameters must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": {"type": "array", "uniqueItems": True}}}}}], "required", "tools", "'uniqueItems' is not supported"),
    ("get_weather", "required", "tools", "list"),
])
def test_what_cannot_be_held_to_is_a_400_naming_it(tools, choice, param, says):
    with pytest.raises(APIError) as info:
        plan(tools, choice)
    assert info.value.status == 400 and info.value.param == param and says in info.value.message


def test_no_tools_or_tool_choice_none_makes_no_plan():
    assert plan(None, None) is None and plan([WEATHER], "none") is None


def test_a_named_function_holds_the_reply_to_its_arguments():
    p = plan([WEATHER, NOW], NAMED)
    assert takes(p, '{"city": "Paris", "unit": "c"}') and takes(p, '{"city":"Oslo"}')
    assert not takes(p, '{"unit": "c"}') and not takes(p, '{"city": "Paris", "when": 1}')
    [call] = p.calls('{"city": "Paris"}  ')
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert p.finish_reason == "stop" and p.calls('{"city": "Par') is None  # cut by max_tokens


def test_required_holds_the_reply_to_calls_of_the_given_functions():
    p = plan([WEATHER, TREE, NOW], "required")
    good = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"parameters": {}, "name": "now"},'
            ' {"name": "plant", "parameters": {"root": {"v": 1, "kids": [{"v": 2}]}, "again": {"root": {"v": 3}}}}]')
    assert takes(p, good)
    for bad in ['[]',  # at least one call
                '[{"name": "get_time", "parameters": {}}]',  # not a given function
                '[{"name": "now", "parameters": {"city": "Paris"}}]',  # another function's arguments
                '[{"name": "plant", "parameters": {"root": {"v": 1, "kids": [{"w": 2}]}}}]',  # its own $ref
                '{"name": "now", "parameters": {}}']:
        assert not takes(p, bad), bad
    calls = p.calls(good)
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now", "plant"]
    assert json.loads(calls[2]["function"]["arguments"]) == json.loads(good)[2]["parameters"]
    assert len({c["id"] for c in calls}) == 3 and p.finish_reason == "tool_calls"
    one = plan([WEATHER, NOW], "required", parallel_tool_calls=False)
    assert takes(one, '[{"name": "now", "parameters": {}}]') and not takes(one, good)
    for call in calls:  # what the plan's schema takes, the tool's own schema takes
        tool = {"get_weather": WEATHER, "now": NOW, "plant": TREE}[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            tool["function"].get("parameters", {"type": "object"}))


def test_a_named_call_streams_its_arguments_and_required_calls_come_whole_at_the_end():
    named = CallStream(plan([WEATHER], NAMED))
    d1, lp1, f1 = named.step('{"city": ', ["a"], None)
    d2, lp2, f2 = named.step('"Paris"}', ["b"], "stop")
    head = d1["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["function"]["name"] == "get_weather"
    assert head["function"]["arguments"] + d2["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert "id" not in d2["tool_calls"][0] and (lp1, lp2, f1, f2) == (["a"], ["b"], None, "stop")

    required = CallStream(plan([WEATHER, NOW], "required"))
    assert required.step('[{"name": "now", ', ["a"], None) == (None, [], None)  # held back
    delta, lp, finish = required.step('"parameters": {}}]', ["b"], "stop")
    assert [c["function"] for c in delta["tool_calls"]] == [{"name": "now", "arguments": "{}"}]
    assert delta["tool_calls"][0]["index"] == 0 and lp == ["a", "b"] and finish == "tool_calls"

    cut = CallStream(plan([WEATHER, NOW], "required"))
    cut.step('[{"name": "n', [], None)
    assert cut.step("ow", [], "length") == ({"content": '[{"name": "now'}, [], "length")


HISTORY = [{"role": "system", "content": "Be brief."},
           {"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
           {"role": "tool", "content": "18 C", "tool_call_id": "call_1"}]


def test_a_template_without_tools_reads_earlier_calls_as_text_and_the_tools_in_the_system_message():
    out = messages(HISTORY, plan([WEATHER], "required"), template_takes_tools=False)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert out[0]["content"].startswith("Be brief.\n\n") and '"name": "get_weather"' in out[0]["content"]
    assert "JSON array of function calls" in out[0]["content"]
    assert json.loads(out[2]["content"]) == [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    assert out[3] == {"role": "tool", "content": "18 C"}
    alone = messages(HISTORY[1:2], plan([WEATHER], NAMED), template_takes_tools=False)
    assert alone[0]["role"] == "system" and "arguments of get_weather" in alone[0]["content"]
    assert messages(HISTORY[1:2], None, template_takes_tools=False) == HISTORY[1:2]  # tool_choice none


def test_a_template_that_writes_tools_gets_the_calls_as_objects():
    out = messages(HISTORY, plan([WEATHER], "required"), template_takes_tools=True)
    assert out[0] == HISTORY[0]  # the template writes the tools itself
    assert out[2]["tool_calls"] == [{"type": "function", "id": "call_1",
                                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert out[3] == HISTORY[3]
