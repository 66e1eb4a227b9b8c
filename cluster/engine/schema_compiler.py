"""Compiling a JSON Schema for structured outputs into the nodes `SchemaRecognizer` walks
(json_schema.py says what is supported). Torch-free: the router compiles each request's schema
to refuse what it cannot enforce (a 400 naming the keyword), and the engine compiles it again
(cached) to constrain the tokens.

    compile_schema(schema) → SchemaRecognizer | SchemaError
    schema_recognizer(json_text) → the same, cached by the schema's text
    schema_text(schema) → the schema as the compact JSON text requests carry, compiled (cached)

Each schema object becomes one `Node`; `$ref`s resolve to the node of their target, so a
recursive schema is a graph. A schema whose required properties refer back to themselves
admits no finite value and is refused; so is a root that is neither an object nor an array
(`response_format` asks for an object, as OpenAI's: `root_kinds` tells the router which it is).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from cluster.engine.json_schema import _FIRST, _KEYWORDS, Node, SchemaError, SchemaRecognizer, _key_bytes

MAX_NODES = 2048  # compiled schema nodes per request
MAX_SCHEMA_DEPTH = 64  # schema objects inside one another
MAX_LITERAL_BYTES = 1 << 16  # all enum/const values of a schema, serialized

_PLAIN = re.compile(r"[A-Za-z0-9_$#/.~-]{1,64}")  # what an error message quotes of the client's schema
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "format",
                          "strict", "deprecated", "readOnly", "writeOnly", "$defs", "definitions"})


@functools.lru_cache(maxsize=64)
def schema_recognizer(text: str) -> SchemaRecognizer:
    """`compile_schema` of a schema given as JSON text, cached (requests reuse their schemas)."""
    try:
        schema = json.loads(text)
    except ValueError:
        raise SchemaError("json_schema is not valid JSON") from None
    except RecursionError:
        raise SchemaError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    return compile_schema(schema)


def schema_text(schema: Any) -> str:
    """`schema` (decoded JSON) as the compact text `SamplingParams.json_schema` carries, once its
    recognizer compiles (cached, so the engine's compile of the same text is a lookup)."""
    try:
        text = json.dumps(schema, separators=(",", ":"), sort_keys=True)
    except RecursionError:  # nested too deep even to print
        raise SchemaError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    schema_recognizer(text)
    return text


def compile_schema(schema: Any) -> SchemaRecognizer:
    """The recognizer of `schema` (a decoded JSON Schema); SchemaError says what is refused."""
    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    compiler = _Compiler(schema)
    compiler.node(schema, "#")
    if any(n is None for n in compiler.nodes):  # a $ref that only ever refers to itself
        raise SchemaError("a $ref could not be resolved")
    nodes: list[Node] = compiler.nodes  # type: ignore[assignment]
    recognizer = SchemaRecognizer(nodes)
    if not _finite(nodes)[0]:
        raise SchemaError("the schema admits no finite JSON value (a required property refers back to itself)")
    if not root_kinds(recognizer) <= {"object", "array"}:
        raise SchemaError("the schema's root must be an object (\"type\": \"object\") or an array")
    return recognizer


def root_kinds(recognizer: SchemaRecognizer) -> set[str]:
    """The JSON types a value of the schema can be: {"object"} for what response_format takes."""
    root = recognizer.nodes[0]
    if root.kind == "union":
        return set(root.union)
    if root.kind == "literal":
        return {_FIRST[o[0]] for o in root.literals}
    return {"number" if root.kind == "integer" else root.kind}


class _Compiler:
    def __init__(self, root: dict[str, Any]) -> None:
        self.root = root
        self.nodes: list[Node | None] = []
        self.refs: dict[str, int] = {}
        self.literal_bytes = 0
        self._any: int | None = None
        self.depth = 0

    def _new(self) -> int:
        if len(self.nodes) >= MAX_NODES:
            raise SchemaError(f"the schema is too large (over {MAX_NODES} nodes)")
        self.nodes.append(None)
        return len(self.nodes) - 1

    def node(self, schema: Any, where: str) -> int:
        self.depth += 1
        try:
            if self.depth > MAX_SCHEMA_DEPTH:
                raise SchemaError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
            return self._node(schema, where)
        finally:
            self.depth -= 1

    def _node(self, schema: Any, where: str) -> int:
        if schema is True or schema == {}:
            return self.any()
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: a schema must be an object or true")
        keys = set(schema) - _ANNOTATIONS
        if "$ref" in schema:
            if keys != {"$ref"}:
                raise SchemaError(f"{where}: $ref beside {_names(keys - {'$ref'})} is not supported")
            return self.ref(schema["$ref"], where)
        if "enum" in schema or "const" in schema:
            return self.literal(schema, keys, where)
        for combinator in ("anyOf", "oneOf"):
            if combinator in schema:
                if keys != {combinator}:
                    raise SchemaError(f"{where}: {combinator} beside {_names(keys - {combinator})} is not supported")
                return self.union(schema[combinator], f"{where}/{combinator}")
        types = schema.get("type")
        if types is None:
            inferred = [t for t in ("object", "array", "string") if keys & (_KEYWORDS[t] - {"type"})]
            if not inferred:
                if keys:
                    raise SchemaError(f"{where}: {_q(sorted(keys)[0])} is not supported")
                return self.any()
            types = inferred[0]
        if isinstance(types, list):
            if not types or not all(isinstance(t, str) and t in _KEYWORDS for t in types) or len(set(types)) != len(types):
                raise SchemaError(f"{where}: type must list distinct JSON types")
            allowed = set().union(*(_KEYWORDS[t] for t in types))
            self._check_keys(keys, allowed, where)
            if len(types) == 1:
                return self.typed(types[0], schema, where)
            n = self._new()
            self.nodes[n] = self._merge([self.typed(t, schema, f"{where}:{t}") for t in types], where)
            return n
        if not isinstance(types, str) or types not in _KEYWORDS:
            raise SchemaError(f"{where}: type {_q(types)} is not a JSON type")
        self._check_keys(keys, _KEYWORDS[types], where)
        return self.typed(types, schema, where)

    @staticmethod
    def _check_keys(keys: set[str], allowed: set[str], where: str) -> None:
        unknown = sorted(keys - allowed)
        if unknown:
            raise SchemaError(f"{where}: {_q(unknown[0])} is not supported")

    def typed(self, kind: str, schema: dict[str, Any], where: str) -> int:
        n = self._new()
        if kind == "object":
            props = schema.get("properties") or {}
            if not isinstance(props, dict):
                raise SchemaError(f"{where}: properties must be an object")
            required = schema.get("required") or []
            if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
                raise SchemaError(f"{where}: required must be a list of names")
            missing = sorted(set(required) - set(props))
            if missing and props:
                raise SchemaError(f"{where}: required {_q(missing[0])} is not among the properties")
            extra_schema = schema.get("additionalProperties", None if props else True)
            if extra_schema is not None and extra_schema is not False and props:
                raise SchemaError(f"{where}: additionalProperties beside properties is not supported")
            if missing:
                raise SchemaError(f"{where}: required {_q(missing[0])} without properties is not supported")
            extra = None if extra_schema in (None, False) else self.node(extra_schema, f"{where}/additionalProperties")
            children = {k: (_key_bytes(k), self.node(v, f"{where}/properties/{_q(k, quote=False)}"))
                        for k, v in props.items()}
            self.nodes[n] = Node("object", props=children, required=frozenset(required), extra=extra)
        elif kind == "array":
            items = schema.get("items", True)
            if isinstance(items, list):
                raise SchemaError(f"{where}: items as a list (tuple validation) is not supported")
            lo, hi = self._bounds(schema, "minItems", "maxItems", where)
            self.nodes[n] = Node("array", items=self.node(items, f"{where}/items"), min_count=lo, max_count=hi)
        elif kind == "string":
            lo, hi = self._bounds(schema, "minLength", "maxLength", where)
            self.nodes[n] = Node("string", min_count=lo, max_count=hi)
        else:
            self.nodes[n] = Node(kind)
        return n

    @staticmethod
    def _bounds(schema: dict[str, Any], low: str, high: str, where: str) -> tuple[int, int]:
        lo, hi = schema.get(low, 0), schema.get(high, 1 << 62)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (lo, hi)) or lo > hi:
            raise SchemaError(f"{where}: {low} and {high} must be integers with {low} <= {high}")
        return lo, hi

    def literal(self, schema: dict[str, Any], keys: set[str], where: str) -> int:
        self._check_keys(keys, {"enum", "const", "type"}, where)
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values:
            raise SchemaError(f"{where}: enum must be a non-empty list")
        if "type" in schema:  # only the values of that type are values of the schema
            types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if not all(isinstance(t, str) and t in _KEYWORDS for t in types):
                raise SchemaError(f"{where}: type must be a JSON type or a list of them")
            values = [v for v in values if any(_is_of_type(v, t) for t in types)]
            if not values:
                raise SchemaError(f"{where}: no value of the enum is of type {_q(schema['type'])}")
        options = tuple(dict.fromkeys(json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode()
                                      for v in values))
        self.literal_bytes += sum(len(o) for o in options)
        if self.literal_bytes > MAX_LITERAL_BYTES:
            raise SchemaError(f"the schema's enum and const values exceed {MAX_LITERAL_BYTES} bytes")
        n = self._new()
        self.nodes[n] = Node("literal", literals=options)
        return n

    def union(self, alternatives: Any, where: str) -> int:
        if not isinstance(alternatives, list) or not alternatives:
            raise SchemaError(f"{where}: must be a non-empty list of schemas")
        n = self._new()
        self.nodes[n] = self._merge([self.node(a, f"{where}/{i}") for i, a in enumerate(alternatives)], where)
        return n

    def _merge(self, children: list[int], where: str) -> Node:
        union: dict[str, tuple[int, ...]] = {}
        for child in children:
            for kind in self._kinds(child, where):
                union[kind] = union.get(kind, ()) + (child,)
        return Node("union", union=union)

    def _kinds(self, n: int, where: str) -> set[str]:
        node = self.nodes[n]
        if node is None:
            raise SchemaError(f"{where}: a $ref alternative that refers back to its own union is not supported")
        if node.kind == "union":
            return set(node.union)
        if node.kind == "literal":
            return {_FIRST[o[0]] for o in node.literals}
        return {"number" if node.kind == "integer" else node.kind}

    def ref(self, path: Any, where: str) -> int:
        if isinstance(path, str) and path in self.refs:
            return self.refs[path]
        if not isinstance(path, str) or not (path == "#" or path.startswith(("#/$defs/", "#/definitions/"))):
            raise SchemaError(f"{where}: $ref {_q(path)}: only '#', '#/$defs/...' and '#/definitions/...' are supported")
        target: Any = self.root
        for part in path.split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise SchemaError(f"{where}: $ref {_q(path)} does not resolve")
            target = target[part]
        if path == "#":
            if not self.nodes:  # the root is nothing but this $ref
                raise SchemaError(f"{where}: $ref '#' at the root refers only to itself")
            self.refs[path] = 0
            return 0
        # the target is compiled into a node that forwards to it, so that recursion finds an id
        n = self._new()
        self.refs[path] = n
        child = self.node(target, _q(path, quote=False))
        self.nodes[n] = self.nodes[child]
        return n

    def any(self) -> int:
        if self._any is None:
            self._any = n = self._new()
            obj, arr = self._new(), self._new()
            self.nodes[obj] = Node("object", extra=n)
            self.nodes[arr] = Node("array", items=n)
            union = {"object": (obj,), "array": (arr,)}
            for kind in ("string", "number", "boolean", "null"):
                union[kind] = (self._new(),)
                self.nodes[union[kind][0]] = Node(kind)
            self.nodes[n] = Node("union", union=union)
        return self._any


def _q(name: Any, quote: bool = True) -> str:
    """A client's key or value as an error message may show it: a short plain name only (an
    error never echoes the request's text at length)."""
    if isinstance(name, str) and _PLAIN.fullmatch(name):
        return repr(name) if quote else name
    return "<a name not shown>"


def _names(keys: set[str]) -> str:
    return "[" + ", ".join(_q(k) for k in sorted(keys)) + "]" if len(keys) <= 8 else f"{len(keys)} keywords"


def _is_of_type(value: Any, kind: Any) -> bool:
    if isinstance(value, bool):
        return kind == "boolean"
    if isinstance(value, int):
        return kind in ("integer", "number")
    if isinstance(value, float):
        return kind == "number" or (kind == "integer" and value.is_integer())
    return {"string": str, "null": type(None), "object": dict, "array": list}.get(kind) is type(value)


def _finite(nodes: list[Node]) -> list[bool]:
    """Which nodes admit a finite JSON value (least fixpoint)."""
    ok = [False] * len(nodes)
    changed = True
    while changed:
        changed = False
        for i, node in enumerate(nodes):
            if ok[i]:
                continue
            if node.kind == "object":
                val = all(ok[node.props[r][1]] for r in node.required)
            elif node.kind == "array":
                val = node.min_count == 0 or ok[node.items]  # type: ignore[index]
            elif node.kind == "union":
                val = any(ok[c] for children in node.union.values() for c in children)
            else:
                val = True
            if val:
                ok[i] = changed = True
    return ok
