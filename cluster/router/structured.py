"""What a reply is held to: OpenAI's `response_format` and vLLM's `structured_outputs` (and its
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`, the same before vLLM 0.12),
checked at the edge and turned into the `StructuredOutput` the engine enforces
(cluster/structured_output.py says what each kind takes and what is refused).

    response_format {"type": "json_object"}        → json_object
    response_format {"type": "json_schema", ...}   → json_schema     (its root must be an object, as OpenAI's)
    structured_outputs {"json_object": true}       → json_object
    structured_outputs {"json": schema}            → json_schema     (a schema as an object or as JSON text)
    structured_outputs {"regex": pattern}          → regex           (the whole reply matches)
    structured_outputs {"choice": [texts]}         → choice          (the reply is exactly one of them)
    structured_outputs {"grammar": ebnf}           → grammar         (xgrammar's EBNF; the start rule is `root`)
    structured_outputs {"structural_tag": json}    → structural_tag  (xgrammar's, as JSON text or an object)

One of these at most per request. `whitespace_pattern` is refused with a 400 naming it, never
silently dropped. What only compiling can tell (an EBNF grammar's syntax, a structural tag's
shape) is refused by the engine: a 400 too, without `param`. Torch-free: nothing here imports a
grammar library.
"""

from __future__ import annotations

import json
import re
from typing import Any

from cluster.router.errors import APIError
from cluster.structured_output import StructuredOutput, StructuredOutputError, root_is_object

_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
UNSUPPORTED = ("whitespace_pattern",)
KEYS = ("choice", "regex", "json", "json_object", "grammar", "structural_tag")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def held_to(response_format: dict[str, Any] | None, structured: dict[str, Any] | None,
            guided: dict[str, Any]) -> StructuredOutput | None:
    """The constraint a request asks for (`structured`: its structured_outputs, validated as a
    `StructuredOutputs`, without unset keys; `guided`: its guided_* fields that are set), None
    for free text, or a 400 naming the field at fault."""
    if guided:
        if structured is not None:
            raise APIError(400, "structured_outputs and guided_* fields exclude each other", param=next(iter(guided)))
        structured = {GUIDED[k]: v for k, v in guided.items()}
        param = next(iter(guided))
    else:
        param = "structured_outputs"
    from_format = _response_format(response_format)
    if structured is None:
        return from_format
    if from_format is not None:
        raise APIError(400, "response_format and structured_outputs exclude each other", param=param)
    for key in UNSUPPORTED:
        if structured.get(key) is not None:
            raise APIError(400, f"structured_outputs.{key} is not supported ({', '.join(KEYS)} are)", param=param)
    given = [k for k in KEYS if structured.get(k) not in (None, False)]
    if len(given) != 1:
        raise APIError(400, f"structured_outputs takes exactly one of {', '.join(KEYS)}", param=param)
    key = given[0]
    value = structured[key]
    try:
        if key == "json_object":
            return StructuredOutput("json_object")
        if key == "json":
            return StructuredOutput.schema(_json_value(value, "structured_outputs.json", param))
        if key == "choice":
            return StructuredOutput.choices(value)
        if key == "structural_tag":
            value = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        if not isinstance(value, str):
            raise StructuredOutputError(f"must be {'text' if key == 'grammar' else 'a string or an object'}")
        return StructuredOutput(key, value)
    except StructuredOutputError as exc:
        raise APIError(400, f"structured_outputs.{key}: {exc}", param=param) from None


def _json_value(value: Any, where: str, param: str) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (ValueError, RecursionError):
            raise APIError(400, f"{where} is not valid JSON", param=param) from None
    return value


def _response_format(response_format: dict[str, Any] | None) -> StructuredOutput | None:
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "text":
        return None
    if kind != "json_schema":
        raise APIError(400, "response_format type must be \"text\", \"json_object\" or \"json_schema\"",
                       param="response_format")
    spec = response_format.get("json_schema")  # type: ignore[union-attr]
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise APIError(400, "response_format.json_schema.schema must be a JSON Schema (an object)",
                       param="response_format")
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and _SCHEMA_NAME.fullmatch(name)):
        raise APIError(400, "response_format.json_schema.name must be 1-64 of a-z A-Z 0-9 _ -",
                       param="response_format")
    where = "response_format.json_schema.schema"
    try:
        held = StructuredOutput.schema(spec["schema"])
    except StructuredOutputError as exc:
        raise APIError(400, f"{where}: {exc}", param="response_format") from None
    if not root_is_object(spec["schema"]):
        raise APIError(400, f"{where}: the schema's root must be an object (\"type\": \"object\")",
                       param="response_format")
    return held
