"""What a reply is held to: OpenAI's `response_format` and vLLM's `structured_outputs` (and its
`guided_json` / `guided_regex` / `guided_choice`, the same before vLLM 0.12), checked at the
edge and turned into the `SamplingParams` fields the engine enforces.

    response_format {"type": "json_object"}        → json_object  (engine/json_mode.py)
    response_format {"type": "json_schema", ...}   → json_schema  (engine/json_schema.py)
    structured_outputs {"json_object": true}       → json_object
    structured_outputs {"json": schema}            → json_schema  (a schema as an object or as JSON text)
    structured_outputs {"regex": pattern}          → regex        (engine/regex.py: the whole reply matches)
    structured_outputs {"choice": [texts]}         → regex        (the reply is exactly one of them)

One of these at most per request. `grammar`, `structural_tag` and `whitespace_pattern` are
refused with a 400 naming them, never silently dropped. A JSON value's root must be an object.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from cluster.engine.json_schema import SchemaError
from cluster.engine.regex import RegexError, choice_pattern, regex_recognizer
from cluster.engine.schema_compiler import root_kinds, schema_recognizer, schema_text
from cluster.router.errors import APIError

_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
UNSUPPORTED = ("grammar", "structural_tag", "whitespace_pattern")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}


@dataclass(frozen=True)
class Held:
    """The request's constraint, as SamplingParams takes it (all unset: free text)."""

    json_object: bool = False
    json_schema: str | None = None
    regex: str | None = None

    @property
    def as_json(self) -> bool:
        return self.json_object or self.json_schema is not None

    @property
    def any(self) -> bool:
        return self.as_json or self.regex is not None


def held_to(response_format: dict[str, Any] | None, structured: dict[str, Any] | None,
            guided: dict[str, Any]) -> Held:
    """The constraint a request asks for (`structured`: its structured_outputs, validated as a
    `StructuredOutputs`, without unset keys; `guided`: its guided_* fields that are set), or a
    400 naming the field at fault."""
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
    if from_format.any:
        raise APIError(400, "response_format and structured_outputs exclude each other", param=param)
    for key in UNSUPPORTED:
        if structured.get(key) is not None:
            raise APIError(400, f"structured_outputs.{key} is not supported (choice, regex, json and "
                                "json_object are)", param=param)
    given = [k for k in ("choice", "regex", "json", "json_object") if structured.get(k) not in (None, False)]
    if len(given) != 1:
        raise APIError(400, "structured_outputs takes exactly one of choice, regex, json and json_object",
                       param=param)
    value = structured[given[0]]
    if given[0] == "json_object":
        return Held(json_object=True)
    if given[0] == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise APIError(400, "structured_outputs.json is not valid JSON", param=param) from None
        return Held(json_schema=_object_schema(value, "structured_outputs.json", param))
    pattern = choice_pattern(value) if given[0] == "choice" else value
    try:
        regex_recognizer(pattern)
    except RegexError as exc:
        raise APIError(400, f"structured_outputs.{given[0]}: {exc}", param=param) from None
    return Held(regex=pattern)


def _response_format(response_format: dict[str, Any] | None) -> Held:
    kind = (response_format or {}).get("type", "text")
    if kind == "json_object":
        return Held(json_object=True)
    if kind == "text":
        return Held()
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
    return Held(json_schema=_object_schema(spec.get("schema"), "response_format.json_schema.schema",
                                           "response_format"))


def _object_schema(schema: Any, where: str, param: str) -> str:
    """`schema` as the compact JSON text SamplingParams.json_schema carries, once checked."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{where} must be a JSON Schema (an object)", param=param)
    try:
        text = schema_text(schema)
        if root_kinds(schema_recognizer(text)) != {"object"}:
            raise SchemaError("the schema's root must be an object (\"type\": \"object\")")
    except SchemaError as exc:
        raise APIError(400, f"{where}: {exc}", param=param) from None
    return text
