"""Structured outputs' recognizer (cluster/engine/json_schema.py, schema_compiler.py): it takes
what a schema admits, byte by byte, refuses what it does not, never leaves a walk with no way
on, and refuses by name the schema keywords it cannot enforce."""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import pytest

from cluster.engine.json_mode import JsonConstraint
from cluster.engine.json_schema import SchemaError
from cluster.engine.schema_compiler import compile_schema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer"},
        "height": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "bc", "b"]}, "minItems": 1, "maxItems": 3},
        "alive": {"type": ["boolean", "null"]},
        "pet": {"anyOf": [{"$ref": "#/$defs/pet"}, {"type": "null"}]},
        "kind": {"const": "person"},
        "meta": {"type": "object", "additionalProperties": {"type": "integer"}},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
    "$defs": {"pet": {"type": "object", "properties": {"name": {"type": "string"}, "friend": {"$ref": "#/$defs/pet"}},
                      "required": ["name"], "additionalProperties": False}},
}
TREE = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v"], "additionalProperties": False}
ANY = {"type": "object"}  # any keys, any values
SHAPES = {  # alternatives of one type: a discriminated union of objects, as pydantic writes one
    "type": "object",
    "properties": {"shapes": {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"$ref": "#/$defs/circle"}, {"$ref": "#/$defs/rect"},
        {"type": "object", "properties": {"kind": {"const": "dot"}}, "required": ["kind"], "additionalProperties": False},
    ]}}, "size": {"anyOf": [{"type": "integer"}, {"type": "number"}, {"enum": ["s", "small"]},
                             {"type": "string", "maxLength": 3}]}},
    "required": ["shapes"], "additionalProperties": False,
    "$defs": {
        "circle": {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                   "required": ["kind", "r"], "additionalProperties": False},
        "rect": {"type": "object", "properties": {"kind": {"const": "rect"}, "w": {"type": "integer"},
                                                  "h": {"type": "integer"}},
                 "required": ["kind", "w", "h"], "additionalProperties": False},
    },
}
SCHEMAS = {"person": PERSON, "tree": TREE, "any": ANY, "shapes": SHAPES}


def accepts(schema: dict, text: str, chunks: int = 1, seed: int = 0) -> tuple[bool, bool]:
    """(a prefix of a value, a whole value) for `text` fed in `chunks` random pieces."""
    r = compile_schema(schema)
    data, rnd, state = text.encode(), random.Random(seed), r.START
    cuts = sorted(rnd.sample(range(1, len(data)), min(chunks - 1, len(data) - 1))) if chunks > 1 else []
    for a, b in zip([0, *cuts], [*cuts, len(data)]):
        state = r.advance(state, data[a:b])
        if state is None:
            return False, False
    return True, r.is_complete(state)


VALID = [
    '{"name":"Bob","age":3,"kind":"person"}',
    '{ "kind" : "person" , "age" : -12 , "name" : "Zoé \\" \\u00e9" , "tags" : [ "bc" , "a" ] ,'
    ' "alive" : null , "height" : 1.5e3 , "pet" : {"name": "Rex", "friend": {"name": "Tom"}}, "meta": {"x": 1, "": 2}}',
    '{"name":"B","age":0,"kind":"person","alive":false,"pet":null,"tags":["b"],"meta":{}}  \n',
]
INVALID = [
    '{"name":"Bob","age":3}',  # a required key missing
    '{"name":"Bob","age":3.5,"kind":"person"}',  # not an integer
    '{"name":"Bob","age":3,"kind":"person","zz":1}',  # a key the schema does not name
    '{"name":"","age":3,"kind":"person"}',  # minLength
    '{"name":"Bobbbbbbbbbbbb","age":3,"kind":"person"}',  # maxLength
    '{"name":"Bob","age":3,"kind":"person","tags":[]}',  # minItems
    '{"name":"Bob","age":3,"kind":"person","tags":["a","a","a","a"]}',  # maxItems
    '{"name":"Bob","age":3,"kind":"person","tags":["c"]}',  # not in the enum
    '{"name":"Bob","age":3,"kind":"people"}',  # not the const
    '{"name":"Bob","age":3,"kind":"person","alive":"yes"}',  # not a type of the list
    '{"name":"Bob","age":3,"kind":"person","pet":{"friend":{"name":"x"}}}',  # the $ref'd required name
    '{"name":"Bob","age":3,"kind":"person","meta":{"x":"1"}}',  # additionalProperties' schema
    '["name"]',  # the root is an object
]
STRICTER = [  # valid for jsonschema (json.loads keeps the last key, skips leading whitespace)
    '{"name":"Bob","age":3,"kind":"person","age":4}',  # a key twice
    ' {"name":"Bob","age":3,"kind":"person"}',  # whitespace before the value: a weak model's trap
]


@pytest.mark.parametrize("chunks", [1, 3, 40])
def test_values_of_the_schema_are_taken_whole_and_in_any_pieces(chunks):
    for text in VALID:
        jsonschema.validate(json.loads(text), PERSON)  # the fixtures themselves are right
        assert accepts(PERSON, text, chunks) == (True, True), text


def test_everything_else_is_refused_at_the_first_byte_that_breaks_it():
    for text in INVALID:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(text), PERSON)
        assert accepts(PERSON, text)[1] is False, text
    for text in STRICTER:
        assert accepts(PERSON, text) == (False, False), text
    assert accepts(PERSON, '{"name":"Bob","age":3,"kind":"person","zz"') == (False, False)
    assert accepts(PERSON, '{"name":"Bob","age":3,"kind":"person"') == (True, False)  # a prefix only


def strict(schema):
    """`schema` as jsonschema should read it: no keys beyond `properties` where they are given."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        s = stack.pop()
        if isinstance(s, dict):
            if "properties" in s:
                s.setdefault("additionalProperties", False)
            stack.extend(s.values())
        elif isinstance(s, list):
            stack.extend(s)
    return schema


ALPHABET = [b for b in range(0x20, 0x7F)] + [0x0A]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_random_walk_never_ends_up_stuck_and_every_end_validates(name):
    schema = SCHEMAS[name]
    r = compile_schema(schema)
    rnd = random.Random(name)
    ends = 0
    for _ in range(60):
        state, out = r.START, bytearray()
        for _ in range(3000):
            if r.is_complete(state):
                break
            allowed = [b for b in ALPHABET if r.advance(state, bytes((b,))) is not None]
            assert allowed, f"stuck after {bytes(out)!r}"
            # structural bytes first, so that the walk ends: strings would run on for ~95 bytes each
            closing = [b for b in allowed if b in b'"}],:']
            b = rnd.choice(closing if closing and rnd.random() < 0.5 else allowed)
            state = r.advance(state, bytes((b,)))
            out.append(b)
        if r.is_complete(state):
            ends += 1
            jsonschema.validate(json.loads(out), strict(schema))
    assert ends >= 50


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("schema,named", [
    ({"type": "object", "properties": {"s": {"type": "string", "pattern": "^a"}}}, "pattern"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}, "minimum"),
    ({"type": "object", "properties": {"t": {"type": "array", "items": [{"type": "string"}]}}}, "tuple"),
    ({"type": "object", "properties": {"r": {"$ref": "https://example.com/s.json"}}}, "$ref"),
    ({"type": "object", "properties": {"r": {"$ref": "#/$defs/missing"}}}, "does not resolve"),
    ({"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}, "no finite"),
    ({"type": "string"}, "root must be an object .* or an array"),
    ({"anyOf": [{"type": "object"}, {"type": "integer"}]}, "root must be an object .* or an array"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True}, "additionalProperties"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]}, "'b'"),
    ({"type": "object", "properties": {"e": {"enum": []}}}, "enum"),
    ({"type": "object", "properties": {"e": {"type": "date"}}}, "date"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 2}}}, "minItems"),
    ({"type": "object", "not": {"type": "object"}}, "'not'"),
    (nested(70), "nests deeper than 64"),
    ({"type": "object", "properties": {"e": {"type": "string", "enum": [1, None]}}}, "no value of the enum"),
    ({"type": "object", "properties": {"t": {"type": {"x": 1}}}}, "not a JSON type"),
    ({"type": "object", "properties": {"t": {"type": ["string", ["null"]]}}}, "distinct JSON types"),
    ({"type": "object", "properties": {"e": {"type": {"x": 1}, "enum": [1]}}}, "type must be a JSON type"),
    ({"type": "object", "properties": {"r": {"$ref": {"a": 1}}}}, "only '#'"),
    ({"$ref": "#"}, "refers only to itself"),
    ({"type": "object", "X" * 5000: 1}, "#: <a name not shown> is not supported"),  # never echoed at length
])
def test_what_it_cannot_enforce_is_refused_by_name(schema, named):
    with pytest.raises(SchemaError, match=named.replace("$", r"\$")):
        compile_schema(schema)


def random_schema(rnd: random.Random, depth: int = 0) -> dict:
    """Schema-shaped JSON: the keywords in any combination, values of any type in them."""
    def value(d: int):
        if d > 3 or rnd.random() < 0.4:
            return rnd.choice([None, True, 0, -1, 1.5, "x", "object", "#", "#/$defs/a", [], {}])
        return [value(d + 1) for _ in range(rnd.randint(0, 2))] if rnd.random() < 0.3 else random_schema(rnd, d + 1)

    names = ["a", "b"]
    makers = {
        "type": lambda: rnd.choice(["object", "array", "string", "integer", "null", ["string", "null"], value(depth)]),
        "properties": lambda: {n: random_schema(rnd, depth + 1) for n in rnd.sample(names, rnd.randint(0, 2))},
        "$defs": lambda: {"a": random_schema(rnd, depth + 1)},
        "required": lambda: rnd.choice([rnd.sample(names, rnd.randint(0, 2)), value(depth)]),
        "$ref": lambda: rnd.choice(["#", "#/$defs/a", "#/$defs/b", "#/properties/a", value(depth)]),
        "anyOf": lambda: [random_schema(rnd, depth + 1) for _ in range(rnd.randint(0, 3))],
    }
    out = {}
    for key in rnd.sample(["items", "additionalProperties", "enum", "const", "minItems", "maxLength", "pattern",
                           *makers], rnd.randint(0, 4)):
        out[key] = makers[key]() if key in makers else value(depth + 1)
    return out


def test_any_schema_either_compiles_or_is_refused_with_a_schema_error():
    """Whatever a client sends as a schema is a 400 naming it, never an exception of another kind
    (a 500): a fuzz over schema-shaped JSON. It found a TypeError for a `type` or `$ref` that is
    not a string and an IndexError for a root that is only {"$ref": "#"}, since fixed."""
    rnd, compiled = random.Random(7), 0
    for _ in range(3000):
        schema = {**random_schema(rnd), **({"type": "object"} if rnd.random() < 0.7 else {})}
        try:
            r = compile_schema(schema)
        except SchemaError:
            continue
        compiled += 1
        state = r.START
        for b in b'{"a":[1,"x",null],"b":{}}':
            state = r.advance(state, bytes((b,))) or state
    assert compiled > 300


def test_the_constraint_runs_a_schema_over_tokens():
    # tokens: the bytes of '{"a":' , 'tru', 'e', '}', ' ', 'x' and an end id (6)
    table = [b'{"a":', b"tru", b"e", b"}", b" ", b"x", None]
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    c = JsonConstraint(table, end_ids=[6], recognizer=compile_schema(schema))
    assert [t for t in range(7) if c.allows(t)] == [0]
    c.sync([0, 1])
    assert [t for t in range(7) if c.allows(t)] == [2] and not c.complete
    c.sync([0, 1, 2, 3])
    assert c.complete and [t for t in range(7) if c.allows(t)] == [4, 6]


def test_sampling_params_refuse_a_schema_they_cannot_enforce():
    from cluster.sampling_params import SamplingParams

    ok = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert SamplingParams(json_schema=ok).json_schema == ok
    with pytest.raises(ValueError, match="'minimum' is not supported"):
        SamplingParams(json_schema=json.dumps({"type": "object", "properties": {"a": {"minimum": 1}}}))
    with pytest.raises(ValueError, match="exclude each other"):
        SamplingParams(json_schema=ok, json_object=True)
    with pytest.raises(ValueError, match="not valid JSON"):
        SamplingParams(json_schema="{")


def test_alternatives_of_one_type_are_followed_until_the_bytes_tell_them_apart():
    for text in ['{"shapes":[{"kind":"circle","r":2.5}]}', '{"shapes":[{"r":1,"kind":"circle"},{"kind":"dot"}]}',
                 '{"shapes":[{"h":1,"kind":"rect","w":2}],"size":"small"}', '{"size":1.5,"shapes":[{"kind":"dot"}]}',
                 '{"shapes":[{"kind":"dot"}],"size":"abc"}', '{"shapes":[{"kind":"dot"}],"size":7}']:
        jsonschema.validate(json.loads(text), SHAPES)
        assert accepts(SHAPES, text, 7) == (True, True), text
    for text in ['{"shapes":[{"kind":"circle","w":2}]}',  # a rect's key in a circle
                 '{"shapes":[{"kind":"rect","w":2}]}',  # a rect without its h
                 '{"shapes":[{"kind":"dot","r":1}]}', '{"shapes":[{"r":1}]}',
                 '{"shapes":[{"kind":"dot"}],"size":"abcd"}']:  # neither the enum nor 3 characters
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(json.loads(text), SHAPES)
        assert accepts(SHAPES, text)[1] is False, text
    # "s" completes one alternative and begins "small": both stay open until the bytes differ
    r = compile_schema(SHAPES)
    state = r.advance(r.START, b'{"shapes":[{"kind":"dot"}],"size":"s')
    assert state is not None and len(state) == 2  # the enum (its "s" and "small"), a 3-character string


def test_forks_past_the_limit_are_dropped_and_what_is_left_still_completes():
    from cluster.engine.json_schema import MAX_ALTERNATIVES

    alts = [{"type": "object", "properties": {"k": {"const": i}}, "required": ["k"], "additionalProperties": False}
            for i in range(40)]
    r = compile_schema({"type": "object", "properties": {"x": {"anyOf": alts}}, "additionalProperties": False})
    state = r.advance(r.START, b'{"x":{"k":')
    assert len(state) == MAX_ALTERNATIVES
    assert r.is_complete(r.advance(state, b"3}}"))  # one of those kept
    assert r.advance(state, b"39}}") is None  # dropped: never produced, so never half-checked


def test_an_enum_with_a_type_keeps_the_values_of_that_type():
    schema = {"type": "object", "properties": {"e": {"type": ["integer", "null"], "enum": [1, "1", 2.0, None, True]}}}
    for value, taken in [("1", True), ('"1"', False), ("2.0", True), ("null", True), ("true", False)]:
        assert accepts(schema, f'{{"e":{value}}}')[1] is taken, value
