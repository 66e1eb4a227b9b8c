"""What a reply is held to (`SamplingParams.structured`), and the checks that need no grammar
library (plain Python, no torch): the router, the CLI and the offline API refuse here, by name,
what the engine's backend (engine/structured/) would reject or silently not enforce.

    StructuredOutput(kind, spec)
      json_object      spec ""                 one JSON object
      json_schema      spec: the schema's JSON one value of the schema (keywords below)
      regex            spec: the pattern       the whole reply matches (as re.fullmatch)
      choice           spec: a JSON list       the reply is exactly one of the strings
      grammar          spec: EBNF text         xgrammar's EBNF (GBNF-like; the start rule is `root`)
      structural_tag   spec: JSON text         xgrammar's structural tag (free text with tagged
                                               JSON sections; its legacy {structures, triggers} too)

JSON schemas: every keyword is either enforced by the backend (`SCHEMA_KEYWORDS`), an annotation
that changes nothing (`ANNOTATIONS`), or refused here: xgrammar 0.2.8 silently ignores `not`,
`allOf`, `if`/`then`/`else`, `uniqueItems`, `dependentRequired`/`dependentSchemas`, unknown keys and
most `format`s, and mis-handles `contains`, `patternProperties` and `propertyNames` (tried: it
admits values they exclude or refuses values they admit). Objects admit only their `properties`
unless `additionalProperties` says otherwise (OpenAI's strict mode). Regexes: what Python's
parser reads, minus what xgrammar's regex converter refuses (backreferences, lookaround, `\\b`,
anchors inside the pattern, inline flags, possessive and atomic groups). An EBNF grammar or a
structural tag is checked only by compiling it (the engine: a 400 without `param`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")
MAX_PATTERN_CHARS = 16384
MAX_SPEC_CHARS = 1 << 17  # a schema, grammar or structural tag, as text
MAX_SCHEMA_DEPTH = 64  # schema objects inside one another
MAX_SCHEMA_NODES = 4096
MAX_CHOICES = 256

SCHEMA_KEYWORDS = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "unevaluatedProperties", "minProperties", "maxProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "$anchor",
                         "strict", "deprecated", "readOnly", "writeOnly"})
FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri",
                     "uri-reference", "uri-template", "uuid", "json-pointer", "relative-json-pointer"})
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SUBSCHEMA = ("additionalProperties", "unevaluatedProperties", "items")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_PLAIN = re.compile(r"[A-Za-z0-9_$#/.~-]{1,64}")  # what an error message quotes of the client's input


class StructuredOutputError(ValueError):
    """What a request asks of structured output that cannot be enforced; the message never
    quotes the client's text at length."""

    def __init__(self, message: str) -> None:
        super().__init__(message if len(message) <= 300 else message[:299] + "…")


@dataclass(frozen=True)
class StructuredOutput:
    """One request's constraint; checked on construction (StructuredOutputError names what is refused)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"structured output kind must be one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str):
            raise StructuredOutputError(f"a {self.kind} constraint's spec must be text")
        if self.kind == "json_object":
            if self.spec:
                raise StructuredOutputError("json_object takes no spec")
            return
        if not self.spec:
            raise StructuredOutputError(f"a {self.kind} constraint needs a non-empty spec")
        if len(self.spec) > (MAX_PATTERN_CHARS if self.kind == "regex" else MAX_SPEC_CHARS):
            raise StructuredOutputError(f"the {self.kind} is too long")
        if "\x00" in self.spec:
            raise StructuredOutputError(f"the {self.kind} must not contain NUL characters")
        if self.kind == "json_schema":
            check_schema(_json(self.spec, "json_schema"))
        elif self.kind == "regex":
            check_regex(self.spec)
        elif self.kind == "choice":
            options = _json(self.spec, "choice")
            if (not isinstance(options, list) or not 0 < len(options) <= MAX_CHOICES
                    or not all(isinstance(o, str) and o for o in options)):
                raise StructuredOutputError(f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings")
        elif self.kind == "structural_tag" and not isinstance(_json(self.spec, "structural_tag"), dict):
            raise StructuredOutputError("structural_tag must be a JSON object")

    @classmethod
    def schema(cls, schema: Any) -> StructuredOutput:
        """A json_schema constraint from a schema given as an object (stored as compact JSON text)."""
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError("a JSON Schema must be an object")
        return cls("json_schema", json.dumps(schema, ensure_ascii=False, separators=(",", ":")))

    @classmethod
    def choices(cls, options: Any) -> StructuredOutput:
        return cls("choice", json.dumps(options, ensure_ascii=False))

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_object", "json_schema")


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        raise StructuredOutputError(f"the {what} is not valid JSON") from None


def q(name: Any) -> str:
    """A client's key or value as an error message may show it: a short plain name only."""
    return repr(name) if isinstance(name, str) and _PLAIN.fullmatch(name) else "<a name not shown>"


# -- JSON schemas ---------------------------------------------------------------------------
def check_schema(schema: Any) -> None:
    """Refuse (StructuredOutputError) a schema with a keyword the backend does not enforce."""
    count = [0]
    _check_node(schema, "#", 0, count)


def _check_node(node: Any, where: str, depth: int, count: list[int]) -> None:
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise StructuredOutputError(f"{where}: a schema must be an object or a boolean")
    count[0] += 1
    if depth > MAX_SCHEMA_DEPTH or count[0] > MAX_SCHEMA_NODES:
        raise StructuredOutputError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} or has more than "
                                    f"{MAX_SCHEMA_NODES} schema objects")
    refused = sorted(k for k in node if k not in SCHEMA_KEYWORDS and k not in ANNOTATIONS)
    if refused:
        names = ", ".join(q(k) for k in refused[:4])
        raise StructuredOutputError(f"{where}: {names} {'is' if len(refused) == 1 else 'are'} not supported")
    _check_values(node, where)
    for key in _SUBSCHEMA:
        if key in node:
            if key == "items" and isinstance(node[key], list):
                raise StructuredOutputError(f"{where}: items as a list is not supported (use prefixItems)")
            _check_node(node[key], f"{where}/{key}", depth + 1, count)
    for key in _SUBSCHEMA_LISTS:
        if key in node:
            if not isinstance(node[key], list) or not node[key]:
                raise StructuredOutputError(f"{where}: {key} must be a non-empty list of schemas")
            for i, child in enumerate(node[key]):
                _check_node(child, f"{where}/{key}/{i}", depth + 1, count)
    for key in _SUBSCHEMA_MAPS:
        if key in node:
            if not isinstance(node[key], dict):
                raise StructuredOutputError(f"{where}: {key} must be an object")
            for name, child in node[key].items():
                _check_node(child, f"{where}/{key}/{_plain(name)}", depth + 1, count)


def _plain(name: Any) -> str:
    return name if isinstance(name, str) and _PLAIN.fullmatch(name) else "<a name not shown>"


def _check_values(node: dict[str, Any], where: str) -> None:
    kind = node.get("type")
    for t in kind if isinstance(kind, list) else [] if kind is None else [kind]:
        if t not in TYPES:
            raise StructuredOutputError(f"{where}: type must be a JSON type or a list of them")
    if "format" in node and node["format"] not in FORMATS:
        raise StructuredOutputError(f"{where}: format {q(node['format'])} is not supported "
                                    f"({', '.join(sorted(FORMATS))} are)")
    if "pattern" in node:
        if not isinstance(node["pattern"], str):
            raise StructuredOutputError(f"{where}: pattern must be a string")
        check_regex(node["pattern"], f"{where}: pattern")
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"):
        value = node.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise StructuredOutputError(f"{where}: {key} must be a number")
    if node.get("multipleOf", 1) <= 0:
        raise StructuredOutputError(f"{where}: multipleOf must be greater than 0")
    for key in ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"):
        value = node.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise StructuredOutputError(f"{where}: {key} must be an integer >= 0")
    ref = node.get("$ref")
    if ref is not None and not (isinstance(ref, str) and (ref == "#" or ref.startswith(("#/$defs/", "#/definitions/")))):
        raise StructuredOutputError(f"{where}: only $refs to '#', '#/$defs/...' and '#/definitions/...' are supported")
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise StructuredOutputError(f"{where}: enum must be a non-empty list")
    if "required" in node and not (isinstance(node["required"], list) and all(isinstance(r, str) for r in node["required"])):
        raise StructuredOutputError(f"{where}: required must be a list of property names")


def root_is_object(schema: Any) -> bool:
    """Whether every value of `schema` is a JSON object (OpenAI's response_format asks for one)."""
    return _root_kinds(schema, schema, 0) == {"object"}


def _root_kinds(node: Any, root: Any, depth: int) -> set[str]:
    if not isinstance(node, dict) or depth > 8:
        return set(TYPES)
    if "$ref" in node:
        target: Any = root
        for part in node["$ref"].split("/")[1:]:
            target = target.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(target, dict) else None
        return _root_kinds(target, root, depth + 1)
    for key in ("anyOf", "oneOf"):
        if key in node:
            return set().union(*(_root_kinds(a, root, depth + 1) for a in node[key]))
    if "const" in node or "enum" in node:
        values = [node["const"]] if "const" in node else node["enum"]
        return {"object" if isinstance(v, dict) else "other" for v in values}
    kind = node.get("type")
    return set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set(TYPES)


# -- regular expressions ---------------------------------------------------------------------
def check_regex(pattern: str, where: str = "regex") -> None:
    """Refuse a pattern that does not parse, or that uses what xgrammar's regex converter does not."""
    from re import _parser  # type: ignore[attr-defined]  # Python's own parser: positions and names

    try:
        parsed = _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        position = f" at position {exc.pos}" if getattr(exc, "pos", None) is not None else ""
        raise StructuredOutputError(f"{where} does not parse: {getattr(exc, 'msg', 'invalid')}{position}") from None
    if parsed.state.flags & ~re.UNICODE:
        raise StructuredOutputError(f"{where}: inline flags are not supported")
    _check_regex_items(list(parsed), where, top=True)


_REGEX_REFUSED = {"GROUPREF": "backreferences are", "GROUPREF_EXISTS": "conditional groups are",
                  "ASSERT": "lookaround is", "ASSERT_NOT": "lookaround is",
                  "POSSESSIVE_REPEAT": "possessive quantifiers are", "ATOMIC_GROUP": "atomic groups are"}


def _check_regex_items(items: list, where: str, top: bool) -> None:
    last = len(items) - 1
    for i, (op, arg) in enumerate(items):
        name = str(op)
        if name in _REGEX_REFUSED:
            raise StructuredOutputError(f"{where}: {_REGEX_REFUSED[name]} not supported")
        if name == "AT":
            edge = (str(arg) in ("AT_BEGINNING", "AT_BEGINNING_STRING") and i == 0) or (
                str(arg) in ("AT_END", "AT_END_STRING") and i == last)
            if not (top and edge):
                raise StructuredOutputError(f"{where}: \\b, \\B and anchors inside the pattern are not supported")
        elif name == "SUBPATTERN":
            if arg[1] or arg[2]:
                raise StructuredOutputError(f"{where}: inline flags are not supported")
            _check_regex_items(list(arg[3]), where, False)
        elif name in ("MAX_REPEAT", "MIN_REPEAT"):
            _check_regex_items(list(arg[2]), where, False)
        elif name == "BRANCH":
            for branch in arg[1]:
                _check_regex_items(list(branch), where, False)
