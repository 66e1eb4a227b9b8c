"""Structured outputs (`response_format: {"type": "json_schema", ...}`): a byte-level recognizer
for the JSON values one schema admits, torch-free. `JsonConstraint` runs it in place of JSON
mode's recognizer (json_mode.py), so the sampler and its bounds are the same.

    schema_compiler.compile_schema(schema) → SchemaRecognizer   (SchemaError names what is refused)
    recognizer.advance(state, data) → state | None;  recognizer.is_complete(state)

Supported, as OpenAI's strict mode and xgrammar's default read a schema:
- `type` (one or a list): object, array, string, number, integer, boolean, null
- objects: `properties` and `required`, in any order, each key at most once; no other keys
  (`additionalProperties` absent or false), or, without `properties`, any keys whose values
  match `additionalProperties` (true or a schema)
- arrays: `items`, `minItems`, `maxItems`; strings: `minLength`, `maxLength` (code points)
- `enum`, `const` (any JSON values, matched in compact form: `json.dumps(v, separators=(",", ":"))`)
- `anyOf` / `oneOf` (alternatives of the same type too: each is followed until the bytes rule
  it out, at most MAX_ALTERNATIVES at once; oneOf is read as anyOf: a value two alternatives
  both admit is not refused)
- `$ref` to `#`, `#/$defs/…` or `#/definitions/…` (recursion allowed; nesting ≤ MAX_DEPTH)
- ignored as annotations: title, description, default, examples, $schema, $id, $comment,
  format (not enforced), strict, deprecated, readOnly, writeOnly
Any other keyword (pattern, minimum, …) is refused: a schema is never silently half-enforced.

The value starts at its first byte (no leading whitespace, as JSON mode); whitespace between
tokens is bounded by MAX_WHITESPACE_RUN and numbers by MAX_NUMBER_BYTES, as JSON mode's. The root
must be an object or an array (a value that shows where it ends).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Union

from cluster.engine.json_mode import (_DIGITS, _ESCAPES, _HEX, _N_CAN_END, _N_INT, _N_MINUS, _N_ZERO, _WS,
                                      MAX_DEPTH, MAX_NUMBER_BYTES, MAX_WHITESPACE_RUN, _number_step)

_KEYWORDS = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
    "string": {"type", "minLength", "maxLength"},
    "number": {"type"}, "integer": {"type"}, "boolean": {"type"}, "null": {"type"},
}
MAX_ALTERNATIVES = 16  # walks followed at once; past it the later ones are dropped (each one left
# is a way to a valid value, so the output stays valid, only some alternatives go unexplored)
_FIRST = {ord("{"): "object", ord("["): "array", ord('"'): "string", ord("t"): "boolean", ord("f"): "boolean",
          ord("n"): "null", ord("-"): "number", **{d: "number" for d in _DIGITS}}


class SchemaError(ValueError):
    """The schema uses something this recognizer does not enforce, or admits no value. The
    message is cut at 300 characters: it may quote the client's keys and keywords."""

    def __init__(self, message: str) -> None:
        super().__init__(message if len(message) <= 300 else message[:299] + "…")


@dataclass(frozen=True)
class Node:
    kind: str  # a JSON type, "literal" (enum/const) or "union"
    literals: tuple[bytes, ...] = ()
    union: dict[str, tuple[int, ...]] = field(default_factory=dict)  # type → nodes (integer under "number")
    props: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # name → (its key bytes, node)
    required: frozenset[str] = frozenset()
    extra: int | None = None  # node of any other key's value (no `properties` only)
    items: int | None = None
    min_count: int = 0  # items or code points
    max_count: int = 1 << 62


# A state is a tuple of walks, each (stack of frames, whitespace run), one per anyOf alternative
# still alive (most often one); a walk with an empty stack is a complete value. Frames:
#   ("V", node)                        a value of `node` comes next
#   ("O", node, seen, phase, key)      phase: "first" | "key" | "inkey" | "colon" | "after"
#   ("A", node, count, phase)          phase: "first" | "after"
#   ("S", min, max, count, esc)        in a string: esc 0, -1 after '\', k > 0 hex digits left
#   ("N", integer, sub, run)           in a number
#   ("L", options)                     in a literal: the options' remaining bytes
Walk = tuple[tuple[tuple, ...], int]
State = tuple[Walk, ...]
Stepped = Union[tuple[tuple[tuple, ...], bool], list, None]  # one (stack, consumed), a list of them, or none


class SchemaRecognizer:
    def __init__(self, nodes: list[Node]) -> None:
        self.nodes = nodes
        self.START: State = (((("V", 0),), 0),)

    @staticmethod
    def is_complete(state: State) -> bool:
        return any(not stack for stack, _ in state)

    def advance(self, state: State, data: bytes) -> State | None:
        """The state after `data`, or None when `data` cannot continue a value of the schema."""
        out: list[Walk] = []
        for stack, run in state:
            self._walk(stack, run, data, 0, out)
        if len(out) < 2:
            return (out[0],) if out else None
        return tuple(dict.fromkeys(out))[:MAX_ALTERNATIVES]

    def _walk(self, stack: tuple[tuple, ...], run: int, data: bytes, i: int, out: list[Walk]) -> None:
        """Append to `out` where one walk stands after `data[i:]` (several, when an anyOf forks it)."""
        n = len(data)
        while i < n:
            top = stack[-1] if stack else None
            if top is not None and top[0] == "S" and top[4] == 0:  # a string's plain bytes, at once
                j = i
                while j < n and data[j] >= 0x20 and data[j] != 0x22 and data[j] != 0x5C:
                    j += 1
                if j > i:
                    count = top[3] + sum(1 for b in data[i:j] if b < 0x80 or b >= 0xC0)  # UTF-8 lead bytes
                    if count > top[2]:
                        return
                    stack, run, i = stack[:-1] + (("S", top[1], top[2], count, 0),), 0, j
                    continue
            byte = data[i]
            if byte in _WS and self._spaces_allowed(stack):
                if run >= MAX_WHITESPACE_RUN and stack:
                    return
                run, i = run + 1, i + 1
                continue
            if not stack:
                return
            stepped = self._step(stack, byte)
            if stepped is None:
                return
            if type(stepped) is list:  # an anyOf: every alternative that `byte` starts walks on
                for other, used in stepped[1:]:
                    self._walk(other, 0 if used else run, data, i + 1 if used else i, out)
                stepped = stepped[0]
            stack, consumed = stepped  # type: ignore[misc]
            if consumed:  # else a number or literal that `byte` ended hands it on to its parent
                run, i = 0, i + 1
        out.append((stack, run))

    @staticmethod
    def _spaces_allowed(stack: tuple[tuple, ...]) -> bool:
        if not stack:
            return True  # after the value
        top = stack[-1]
        if top[0] == "V":
            return len(stack) > 1  # not before the value itself
        return (top[0] == "O" and top[3] != "inkey") or top[0] == "A"

    def _step(self, stack: tuple[tuple, ...], byte: int) -> Stepped:
        top, rest = stack[-1], stack[:-1]
        kind = top[0]
        if kind == "S":
            _, lo, hi, count, esc = top
            if esc == 0:
                if byte == 0x22:
                    return (rest, True) if count >= lo else None
                if byte < 0x20:
                    return None
                new = count + (1 if byte < 0x80 or byte >= 0xC0 else 0)  # UTF-8 lead bytes
                if new > hi:
                    return None
                return rest + (("S", lo, hi, new, -1 if byte == 0x5C else 0),), True
            if esc == -1:
                if byte == 0x75:
                    return rest + (("S", lo, hi, count, 4),), True
                return (rest + (("S", lo, hi, count, 0),), True) if byte in _ESCAPES else None
            return (rest + (("S", lo, hi, count, esc - 1),), True) if byte in _HEX else None
        if kind == "N":
            _, integer, sub, nrun = top
            nxt = None if integer and byte in b".eE" else _number_step(sub, byte)
            if nxt is not None:
                return (rest + (("N", integer, nxt, nrun + 1),), True) if nrun < MAX_NUMBER_BYTES else None
            return (rest, False) if sub in _N_CAN_END else None
        if kind == "L":
            options = top[1]
            matching = tuple(o[1:] for o in options if o and o[0] == byte)
            if matching:
                return (rest, True) if not any(matching) else (rest + (("L", matching),), True)
            return (rest, False) if b"" in options else None
        if kind == "V":
            return self._start(rest, top[1], byte)
        if kind == "O":
            return self._object(rest, top, byte)
        return self._array(rest, top, byte)

    def _start(self, rest: tuple[tuple, ...], n: int, byte: int) -> Stepped:
        node = self.nodes[n]
        if node.kind == "literal":
            return self._step(rest + (("L", node.literals),), byte)
        kind = _FIRST.get(byte)
        if node.kind == "union":
            children = node.union.get(kind, ()) if kind is not None else ()
            if len(children) == 1:
                return self._start(rest, children[0], byte)
            forks = []
            for child in children:
                stepped = self._start(rest, child, byte)
                forks += stepped if type(stepped) is list else [] if stepped is None else [stepped]
            return forks if len(forks) > 1 else forks[0] if forks else None
        if kind != node.kind and not (kind == "number" and node.kind == "integer"):
            return None
        if kind in ("object", "array"):
            if sum(1 for f in rest if f[0] in "OA") >= MAX_DEPTH:
                return None
            frame = ("O", n, frozenset(), "first", None) if kind == "object" else ("A", n, 0, "first")
            return rest + (frame,), True
        if kind == "string":
            return rest + (("S", node.min_count, node.max_count, 0, 0),), True
        if kind == "number":
            return rest + (("N", node.kind == "integer", _first_number_sub(byte), 1),), True
        return rest + (("L", (b"rue",) if byte == 0x74 else (b"alse",) if byte == 0x66 else (b"ull",)),), True

    def _object(self, rest: tuple[tuple, ...], top: tuple, byte: int) -> Stepped:
        _, n, seen, phase, key = top
        node = self.nodes[n]
        if phase in ("first", "key"):
            if byte == 0x7D and phase == "first" and not node.required:
                return rest, True
            if byte != 0x22:
                return None
            if node.extra is not None:  # any key: its string, then the colon
                return rest + (("O", n, seen, "colon", None), ("S", 0, 1 << 62, 0, 0)), True
            options = tuple((k, name) for name, (k, _) in node.props.items() if name not in seen)
            return (rest + (("O", n, seen, "inkey", options),), True) if options else None
        if phase == "inkey":
            matching = tuple((k[1:], name) for k, name in key if k[0] == byte)
            if not matching:
                return None
            done = [name for k, name in matching if not k]
            if done:  # the closing quote: one key only
                return rest + (("O", n, seen, "colon", done[0]),), True
            return rest + (("O", n, seen, "inkey", matching),), True
        if phase == "colon":
            if byte != 0x3A:
                return None
            child = node.extra if key is None else node.props[key][1]
            seen = seen if key is None else seen | {key}
            return rest + (("O", n, seen, "after", None), ("V", child)), True
        # after a value
        if byte == 0x2C:
            more = node.extra is not None or any(name not in seen for name in node.props)
            return (rest + (("O", n, seen, "key", None),), True) if more else None
        if byte == 0x7D:
            return (rest, True) if node.required <= seen else None
        return None

    def _array(self, rest: tuple[tuple, ...], top: tuple, byte: int) -> Stepped:
        _, n, count, phase = top
        node = self.nodes[n]
        if byte == 0x5D:
            return (rest, True) if count >= node.min_count else None
        if phase == "after":
            if byte != 0x2C or count >= node.max_count:
                return None
            return rest + (("A", n, count + 1, "after"), ("V", node.items)), True
        if node.max_count == 0:
            return None
        return self._start(rest + (("A", n, 1, "after"),), node.items, byte)


def _first_number_sub(byte: int) -> int:
    return _N_MINUS if byte == 0x2D else _N_ZERO if byte == 0x30 else _N_INT


def _key_bytes(name: str) -> bytes:
    """A key as matched after its opening quote: its JSON string form, closing quote included."""
    return json.dumps(name, ensure_ascii=False).encode()[1:]

