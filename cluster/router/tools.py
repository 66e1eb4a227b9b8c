"""Tool calling (`tools`, `tool_choice`) by structured output: the reply is held to the calls'
JSON, so every call names a given function and its arguments are a value of that function's
`parameters` schema (cluster/structured_output.py says which keywords), whatever the model.

    plan(tools, tool_choice, parallel_tool_calls) → ToolPlan | None   (APIError on bad input)
    messages(conversation, plan, template_takes_tools) → the conversation the template reads
    ToolPlan.calls(text) → the reply's tool_calls (None: the reply was cut before they close)

tool_choice, as vLLM serves it:
- a named function `{"type": "function", "function": {"name": …}}`: the reply is that function's
  arguments, one JSON object; finish_reason "stop" (as OpenAI's for a forced call)
- "required": a JSON array `[{"name": …, "parameters": {…}}, …]` of one or more calls (one when
  parallel_tool_calls is false); finish_reason "tool_calls"
- "none": no calls, plain text
- "auto" (OpenAI's default when tools are given) needs a parser of the model's own tool-call
  format, which Tandem does not have: a 400 that says which choices work
A model whose chat template writes `tools` gets them there; any other is told about them in the
system message (the functions' JSON and the reply's shape), so that it knows what to fill in.
"""

from __future__ import annotations

import copy
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from cluster.router.errors import APIError
from cluster.structured_output import StructuredOutput, StructuredOutputError

MAX_TOOLS = 128
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {name, description?, parameters}}
    named: str | None  # the forced function, or None for "required"
    parallel: bool
    schema: StructuredOutput  # what the reply is held to (a json_schema)

    @property
    def finish_reason(self) -> str:
        return "stop" if self.named else "tool_calls"

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The reply's tool calls, each with a fresh id; None when `text` is not their whole JSON."""
        if self.named:
            try:
                json.loads(text)
            except ValueError:
                return None
            return [_call(self.named, text.strip())]
        try:
            return [_call(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return None

    def instructions(self) -> str:
        """What a model whose template does not write tools is told in the system message."""
        listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in self.tools)
        if self.named:
            ask = f"Reply with the arguments of {self.named} as one JSON object, and nothing else."
        else:
            ask = ('Reply with a JSON array of function calls, [{"name": …, "parameters": {…}}]'
                   + ("" if self.parallel else ", exactly one") + ", and nothing else.")
        return f"You can call these functions (each one's parameters as a JSON Schema):\n{listed}\n{ask}"


def messages(conversation: list[dict[str, Any]], plan: ToolPlan | None,
             template_takes_tools: bool) -> list[dict[str, Any]]:
    """The conversation as the chat template reads it. A template that writes tools itself gets
    earlier calls as `tool_calls` (arguments as objects, as HF templates expect) and tool
    results with their `tool_call_id`; any other gets earlier calls as the JSON text a reply
    with calls is (`[{"name": …, "parameters": {…}}]`) and, when calls may be made now, the
    tools and the reply's shape in the system message."""
    out = []
    for m in conversation:
        calls = m.get("tool_calls")
        if not template_takes_tools:
            text = _as_text(calls) if calls else m["content"]
            out.append({"role": m["role"], "content": text})
            continue
        if calls:
            m = {**m, "tool_calls": [{"type": "function", "id": c.get("id"), "function": {
                "name": c["function"]["name"], "arguments": _loads_or_text(c["function"]["arguments"])}}
                for c in calls]}
        out.append(m)
    if plan is None or template_takes_tools:
        return out
    if out and out[0]["role"] == "system":
        return [{"role": "system", "content": f"{out[0]['content']}\n\n{plan.instructions()}"}, *out[1:]]
    return [{"role": "system", "content": plan.instructions()}, *out]


def plan(tools: Any, tool_choice: Any, parallel_tool_calls: Any = True) -> ToolPlan | None:
    """What `tools` and `tool_choice` ask for, checked; None when no call may be made."""
    if tool_choice == "none" or (not tools and tool_choice is None):
        return None
    if not tools:
        raise APIError(400, "tool_choice needs tools", param="tool_choice")
    checked = _check_tools(tools)
    if not isinstance(parallel_tool_calls, bool):
        raise APIError(400, "parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tool_choice in (None, "auto"):
        raise APIError(400, 'tool_choice "auto" (the default with tools) needs a parser of this model\'s own '
                            'tool-call format, which this server does not have: send tool_choice "required", '
                            '{"type": "function", "function": {"name": …}} or "none"', param="tool_choice")
    params = {t["function"]["name"]: t["function"]["parameters"] for t in checked}
    if tool_choice == "required":
        return ToolPlan(checked, None, parallel_tool_calls, StructuredOutput.schema(_calls_schema(params, parallel_tool_calls)))
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not (isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(name, str)):
        raise APIError(400, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                            '"function": {"name": …}}', param="tool_choice")
    if name not in params:
        raise APIError(400, "tool_choice names a function that is not among the tools", param="tool_choice")
    return ToolPlan(checked, name, False, StructuredOutput.schema(params[name]))


def _check_tools(tools: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools must be a list of at most {MAX_TOOLS} functions", param="tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)):
            raise APIError(400, f'tools[{i}] must be {{"type": "function", "function": {{…}}}}', param="tools")
        name, params = fn.get("name"), fn.get("parameters", _NO_PARAMETERS)
        if not (isinstance(name, str) and _NAME.fullmatch(name)):
            raise APIError(400, f"tools[{i}].function.name must be 1-64 of a-z A-Z 0-9 _ -", param="tools")
        if name in names:
            raise APIError(400, f"tools[{i}] has the name of an earlier tool", param="tools")
        names.add(name)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise APIError(400, f"tools[{i}].function.parameters must be a JSON Schema of an object", param="tools")
        try:
            StructuredOutput.schema(params)
        except StructuredOutputError as exc:
            raise APIError(400, f"tools[{i}].function.parameters: {exc}", param="tools") from None
        entry = {"name": name, "parameters": params}
        if isinstance(fn.get("description"), str):
            entry["description"] = fn["description"]
        out.append({"type": "function", "function": entry})
    return tuple(out)


def _calls_schema(params: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls; each function's parameters moved under $defs, their $refs with them."""
    defs = {f"tool{i}": _moved(p, f"#/$defs/tool{i}") for i, p in enumerate(params.values())}
    alternatives = [{"type": "object", "properties": {"name": {"const": name}, "parameters": {"$ref": f"#/$defs/tool{i}"}},
                     "required": ["name", "parameters"], "additionalProperties": False}
                    for i, name in enumerate(params)]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": alternatives}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _moved(schema: Any, base: str) -> Any:
    """`schema` with every $ref into itself ("#", "#/$defs/…") rewritten to point under `base`."""
    schema = copy.deepcopy(schema)
    todo = [schema]
    while todo:
        s = todo.pop()
        if not isinstance(s, dict):
            continue
        if isinstance(s.get("$ref"), str) and s["$ref"].startswith("#"):
            s["$ref"] = base + s["$ref"][1:]
        for key in ("properties", "$defs", "definitions"):
            if isinstance(s.get(key), dict):
                todo.extend(s[key].values())
        for key in ("items", "additionalProperties", "unevaluatedProperties"):
            todo.append(s.get(key))
        for key in ("anyOf", "oneOf", "prefixItems"):
            if isinstance(s.get(key), list):
                todo.extend(s[key])
    return schema


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _as_text(calls: list[dict[str, Any]]) -> str:
    return json.dumps([{"name": c["function"]["name"], "parameters": _loads_or_text(c["function"]["arguments"])}
                       for c in calls], ensure_ascii=False)


def _loads_or_text(arguments: Any) -> Any:
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class CallStream:
    """One streamed choice's calls. A named function's arguments go out as they come (its id
    and name in the first delta, as OpenAI streams them); "required" calls are held until the
    reply ends, then sent whole, one entry per call (a reply cut before they close: its text)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan, self.text, self.held = plan, "", []  # held: logprob entries not sent yet

    def step(self, text: str, logprobs: list, finish: str | None) -> tuple[dict[str, Any] | None, list, str | None]:
        """(the chunk's delta, or None to send nothing yet; its logprob entries; its finish_reason)."""
        first, self.text = not self.text and bool(text), self.text + text
        logprobs, self.held = self.held + logprobs, []
        calls = self.plan.calls(self.text) if finish else None
        if finish:
            finish = self.plan.finish_reason if calls is not None else finish
        if self.plan.named:
            if first:
                head = _call(self.plan.named, text)
                return {"tool_calls": [{"index": 0, **head}]}, logprobs, finish
            return ({"tool_calls": [{"index": 0, "function": {"arguments": text}}]} if text else {}), logprobs, finish
        if not finish:
            self.held = logprobs
            return None, [], None
        if calls is None:
            return ({"content": self.text} if self.text else {}), logprobs, finish
        return {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}, logprobs, finish
