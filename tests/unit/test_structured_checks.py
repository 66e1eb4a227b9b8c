"""What a request may hold a reply to (cluster/structured_output.py), checked without a grammar
library: keywords and regex constructs the backend would reject or silently not enforce are
refused by name, never echoing the client's text; everything the backend does enforce passes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.sampling_params import SamplingParams
from cluster.structured_output import (MAX_SCHEMA_DEPTH, SCHEMA_KEYWORDS, StructuredOutput, StructuredOutputError,
                                       root_is_object)

ENFORCED = {  # one schema per keyword family the backend enforces (tests/unit/test_structured_backend.py)
    "type": "object", "additionalProperties": False, "required": ["a"], "minProperties": 1, "maxProperties": 6,
    "properties": {
        "a": {"type": "string", "pattern": "^[a-z]+$", "minLength": 1, "maxLength": 8, "format": "email"},
        "n": {"type": "integer", "minimum": 1, "maximum": 9, "multipleOf": 2},
        "x": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1.5},
        "t": {"type": "array", "prefixItems": [{"const": 1}], "items": {"enum": ["p", None]}, "minItems": 1, "maxItems": 3},
        "u": {"anyOf": [{"$ref": "#/$defs/leaf"}, {"type": "null"}]},
        "v": {"oneOf": [{"type": "boolean"}, {"type": ["integer", "null"]}], "title": "t", "description": "d"},
    },
    "$defs": {"leaf": {"type": "object", "unevaluatedProperties": False, "properties": {"up": {"$ref": "#"}}}},
}


def test_what_the_backend_enforces_passes_and_is_kept_as_compact_json():
    held = StructuredOutput.schema(ENFORCED)
    assert held.kind == "json_schema" and json.loads(held.spec) == ENFORCED and ": " not in held.spec
    assert SamplingParams(structured=held).structured == held
    for kind, spec in [("json_object", ""), ("regex", r"^[0-9]{3}-(?:ab|c)+\.\d*$"), ("choice", '["a", "b (c)"]'),
                       ("grammar", 'root ::= "a"'), ("structural_tag", '{"type": "structural_tag"}')]:
        assert StructuredOutput(kind, spec).kind == kind


@pytest.mark.parametrize("schema, named", [
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "'not' is not supported"),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "'allOf' is not supported"),
    ({"type": "object", "if": {}, "then": {}}, "'if', 'then' are not supported"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' is not supported"),
    ({"type": "array", "contains": {"type": "string"}}, "'contains' is not supported"),
    ({"type": "object", "patternProperties": {"^x": {}}}, "'patternProperties' is not supported"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired' is not supported"),
    ({"type": "object", "properties": {"s": {"type": "string", "format": "binary"}}}, "format 'binary' is not supported"),
    ({"type": "object", "properties": {"s": {"pattern": "(a)\\1"}}}, "pattern: backreferences are not supported"),
    ({"type": "object", "properties": {"n": {"minimum": "3"}}}, "minimum must be a number"),
    ({"type": "object", "properties": {"n": {"type": "int"}}}, "type must be a JSON type"),
    ({"type": "array", "items": [{"type": "string"}]}, "items as a list is not supported"),
    ({"type": "object", "properties": {"a": {"$ref": "http://example.com/s"}}}, "only $refs to"),
    ({"type": "object", "ZQXMARK" * 20: 1}, "<a name not shown> is not supported"),
])
def test_what_the_backend_would_not_enforce_is_refused_by_name(schema, named):
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutput.schema(schema)
    assert named in str(info.value) and "ZQXMARK" not in str(info.value)
    with pytest.raises(ValueError):  # the offline API refuses it the same way, before any engine
        SamplingParams(structured=StructuredOutput("json_schema", json.dumps(schema)))


def test_a_schema_nested_past_the_limit_is_refused_before_it_reaches_a_compiler():
    schema: dict = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH + 1):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(StructuredOutputError, match="nests deeper"):
        StructuredOutput.schema(schema)


@pytest.mark.parametrize("pattern, named", [
    (r"(a)\1", "backreferences are not supported"), (r"(?=a)b", "lookaround is not supported"),
    (r"a(?<!b)", "lookaround is not supported"), (r"\bword", "anchors inside the pattern"),
    (r"a^b", "anchors inside the pattern"), (r"(?i)abc", "inline flags"), (r"a(?s:.)", "inline flags"),
    (r"a++", "possessive quantifiers"), (r"(?>ab)", "atomic groups"), ("[ab", "does not parse: unterminated character set at position 0"),
    ("a{3,1}", "does not parse"),
])
def test_a_regex_the_backend_cannot_enforce_is_refused_by_name(pattern, named):
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutput("regex", pattern)
    assert named in str(info.value)


@pytest.mark.parametrize("kind, spec, says", [
    ("json_object", "{}", "takes no spec"), ("regex", "", "non-empty spec"), ("choice", "[]", "list of 1 to"),
    ("choice", '["a", ""]', "non-empty strings"), ("choice", "[1", "not valid JSON"), ("grammar", "root ::= \x00", "NUL"),
    ("structural_tag", "[]", "a JSON object"), ("ebnf", "x", "kind must be one of"),
])
def test_a_malformed_spec_is_refused(kind, spec, says):
    with pytest.raises(StructuredOutputError, match=says):
        StructuredOutput(kind, spec)


def test_the_root_of_a_response_format_schema_is_an_object_only_when_every_value_is():
    assert root_is_object({"type": "object"}) and root_is_object({"$ref": "#/$defs/o", "$defs": {"o": {"type": "object"}}})
    assert root_is_object({"anyOf": [{"type": "object"}, {"const": {"a": 1}}]})
    for schema in ({}, {"type": "string"}, {"type": ["object", "null"]}, {"anyOf": [{"type": "object"}, {"enum": [1]}]}):
        assert not root_is_object(schema), schema


def test_every_enforced_keyword_is_known_to_the_checks():
    assert {"pattern", "minimum", "maximum", "format"} <= SCHEMA_KEYWORDS


def test_the_checks_and_the_request_types_import_no_torch_and_no_grammar_library():
    code = ("import sys, cluster.structured_output, cluster.sampling_params, cluster.router.structured, "
            "cluster.router.tools; print(sorted(m for m in ('torch', 'xgrammar') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
