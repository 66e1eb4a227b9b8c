"""JSON mode (`response_format: {"type": "json_object"}`): which next tokens keep the output a
valid JSON object, torch-free.

Three pieces:
- `JsonRecognizer`: a byte-level pushdown recognizer for one JSON object (RFC 8259), fed a byte
  string at a time; its state is a small immutable tuple, so trying a candidate token costs
  one `advance` and nothing has to be undone.
- `token_bytes(tokenizer)`: each token id's bytes (byte-level BPE, SentencePiece with byte
  fallback); special and added tokens have none and are never allowed mid-JSON.
- `JsonConstraint`: one request's recognizer (this one, or a JSON schema's: json_schema.py),
  kept in step with its output tokens. The sampler asks it which of a few candidate tokens are
  allowed (see sampler.py for the order); once the object is complete, its `trailing_ids` (the
  whitespace-only tokens) and end ids are all that may follow, a shortlist the sampler ranks
  instead of the vocabulary.

What it guarantees: every output is a prefix of a JSON object, starting at its "{" (no
whitespace before it: a weak model would spend its tokens there), and EOS (or a stop_token_id)
is allowed only once that object is complete, after which only whitespace or EOS may follow;
the sampler then ends the reply (sampler.py: whitespace only while min_tokens holds EOS back).
A request cut by max_tokens ends with an incomplete object, finish_reason "length", as
OpenAI's. Bounds keep a weak model from looping: at most 32 levels of nesting, 64 bytes per
number and 64 whitespace bytes in a row (after the object any number, so min_tokens can always
be met). Strings are checked for escapes and control characters; their non-ASCII bytes are
passed through (a tokenizer emits UTF-8 a byte-token at a time).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

MAX_DEPTH = 32
MAX_NUMBER_BYTES = 64
MAX_WHITESPACE_RUN = 64

# modes
_START, _OBJ_FIRST, _OBJ_KEY, _COLON, _VALUE, _ARR_FIRST, _AFTER, _DONE = range(8)
_STRING, _ESCAPE, _UHEX, _NUMBER, _LITERAL = range(8, 13)
_STRUCTURAL = frozenset({_START, _OBJ_FIRST, _OBJ_KEY, _COLON, _VALUE, _ARR_FIRST, _AFTER, _DONE})
# number sub-states: after '-', a leading 0, integer digits, after '.', fraction digits, after
# 'e', after the exponent's sign, exponent digits; the ones a number may end in
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_EXP, _N_EXP_SIGN, _N_EXP_DIGITS = range(8)
_N_CAN_END = frozenset({_N_ZERO, _N_INT, _N_FRAC, _N_EXP_DIGITS})

_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')
_LITERALS = {ord("t"): b"rue", ord("f"): b"alse", ord("n"): b"ull"}

# (mode, stack of open containers as bytes, aux, run): aux is the string's key flag (in an
# escape too; after \\u: (key flag, hex digits left)), the number's sub-state or the literal's
# remaining bytes; run counts whitespace in a row (structural modes) or the number's bytes
State = tuple[int, bytes, Any, int]


class JsonRecognizer:
    START: State = (_START, b"", None, 0)

    @staticmethod
    def is_complete(state: State) -> bool:
        return state[0] == _DONE

    @classmethod
    def advance(cls, state: State, data: bytes) -> State | None:
        """The state after `data`, or None when `data` cannot continue a JSON object."""
        mode, stack, aux, run = state
        for byte in data:
            if mode == _STRING:
                if byte == 0x22:  # '"'
                    mode, aux, run = (_COLON, None, 0) if aux else cls._closed(stack)
                elif byte == 0x5C:  # '\\'
                    mode = _ESCAPE
                elif byte < 0x20:
                    return None
                continue
            if mode == _NUMBER:
                nxt = _number_step(aux, byte)
                if nxt is not None:
                    if run >= MAX_NUMBER_BYTES:
                        return None
                    aux, run = nxt, run + 1
                    continue
                if aux not in _N_CAN_END:
                    return None
                mode, aux, run = _AFTER, None, 0  # the byte that ended the number is read below
            if mode in _STRUCTURAL:
                if byte in _WS:
                    if mode == _START or (run >= MAX_WHITESPACE_RUN and mode != _DONE):
                        return None
                    run += 1
                    continue
                run = 0
                nxt = cls._structural(mode, stack, byte)
                if nxt is None:
                    return None
                mode, stack, aux, run = nxt
            elif mode == _ESCAPE:
                if byte == 0x75:  # 'u'
                    mode, aux = _UHEX, (aux, 4)
                elif byte in _ESCAPES:
                    mode = _STRING
                else:
                    return None
            elif mode == _UHEX:
                if byte not in _HEX:
                    return None
                key, left = aux
                mode, aux = (_STRING, key) if left == 1 else (_UHEX, (key, left - 1))
            else:  # _LITERAL
                if byte != aux[0]:
                    return None
                mode, aux, run = (_LITERAL, aux[1:], 0) if len(aux) > 1 else cls._closed(stack)
        return (mode, stack, aux, run)

    @staticmethod
    def _closed(stack: bytes) -> tuple[int, None, int]:
        """(mode, aux, run) after a value ends inside `stack`."""
        return (_AFTER if stack else _DONE), None, 0

    @classmethod
    def _structural(cls, mode: int, stack: bytes, byte: int) -> State | None:
        if mode == _START:
            return (_OBJ_FIRST, b"{", None, 0) if byte == 0x7B else None
        if mode in (_OBJ_FIRST, _OBJ_KEY):
            if byte == 0x22:
                return (_STRING, stack, True, 0)
            if byte == 0x7D and mode == _OBJ_FIRST:
                return cls._pop(stack)
            return None
        if mode == _COLON:
            return (_VALUE, stack, None, 0) if byte == 0x3A else None
        if mode == _AFTER:
            top = stack[-1]
            if byte == 0x2C:  # ','
                return (_OBJ_KEY if top == 0x7B else _VALUE, stack, None, 0)
            if (byte == 0x7D and top == 0x7B) or (byte == 0x5D and top == 0x5B):
                return cls._pop(stack)
            return None
        if mode == _ARR_FIRST and byte == 0x5D:
            return cls._pop(stack)
        if mode in (_VALUE, _ARR_FIRST):
            return cls._value_start(stack, byte)
        return None  # _DONE: only whitespace

    @staticmethod
    def _pop(stack: bytes) -> State:
        rest = stack[:-1]
        return ((_AFTER if rest else _DONE), rest, None, 0)

    @staticmethod
    def _value_start(stack: bytes, byte: int) -> State | None:
        if byte in (0x7B, 0x5B):  # '{' '['
            if len(stack) >= MAX_DEPTH:
                return None
            return (_OBJ_FIRST if byte == 0x7B else _ARR_FIRST, stack + bytes((byte,)), None, 0)
        if byte == 0x22:
            return (_STRING, stack, False, 0)
        if byte == 0x2D:  # '-'
            return (_NUMBER, stack, _N_MINUS, 1)
        if byte in _DIGITS:
            return (_NUMBER, stack, _N_ZERO if byte == 0x30 else _N_INT, 1)
        if byte in _LITERALS:
            return (_LITERAL, stack, _LITERALS[byte], 0)
        return None


def _number_step(sub: int, byte: int) -> int | None:
    """The number's next sub-state after `byte`, or None when `byte` does not extend it."""
    digit = byte in _DIGITS
    if sub == _N_MINUS:
        return (_N_ZERO if byte == 0x30 else _N_INT) if digit else None
    if sub in (_N_ZERO, _N_INT, _N_FRAC):
        if digit and sub != _N_ZERO:
            return sub
        if byte == 0x2E and sub != _N_FRAC:  # '.'
            return _N_DOT
        if byte in (0x65, 0x45):  # 'e' 'E'
            return _N_EXP
        return None
    if sub == _N_DOT:
        return _N_FRAC if digit else None
    if sub == _N_EXP:
        if byte in (0x2B, 0x2D):
            return _N_EXP_SIGN
        return _N_EXP_DIGITS if digit else None
    return _N_EXP_DIGITS if digit else None  # _N_EXP_SIGN, _N_EXP_DIGITS


class JsonConstraint:
    """One request's JSON-mode state. `sync` with its output tokens before asking `allows`.

    `replay` output tokens that came before this engine saw the request (a migrated request's
    tail of the prompt) are consumed first. A token that cannot continue the JSON (only
    possible if it was chosen without this constraint) ends the constraint: the request goes on
    unconstrained rather than failing.
    """

    def __init__(self, table: Sequence[bytes | None], end_ids: Collection[int],
                 replay: Sequence[int] = (), trailing_ids: Sequence[int] | None = None,
                 recognizer: Any = JsonRecognizer) -> None:
        """`trailing_ids`: `whitespace_ids(table)`, passed in when the caller keeps it per table.
        `recognizer`: JSON mode's, a schema's (json_schema.py) or a pattern's (regex.py): START,
        advance, is_complete, and `can_end` where a value may end but also go on (a regex's \\d+)."""
        self.table = table
        self.end_ids = frozenset(end_ids)
        self.trailing_ids = whitespace_ids(table) if trailing_ids is None else trailing_ids
        self.recognizer = recognizer
        self._can_end = getattr(recognizer, "can_end", recognizer.is_complete)
        self.state: Any = recognizer.START
        self.seen = 0
        self._feed(replay)

    @property
    def active(self) -> bool:
        return self.state is not None

    @property
    def complete(self) -> bool:
        """The object is closed: only `trailing_ids` and `end_ids` may come next."""
        return self.state is not None and self.recognizer.is_complete(self.state)

    def sync(self, output_ids: Sequence[int]) -> None:
        self._feed(output_ids[self.seen:])
        self.seen = len(output_ids)

    def allows(self, token_id: int) -> bool:
        """Whether `token_id` may come next (an ended constraint allows anything)."""
        if self.state is None:
            return True
        if token_id in self.end_ids:
            return self._can_end(self.state)
        return self._next(self.state, token_id) is not None

    def _feed(self, token_ids: Sequence[int]) -> None:
        for t in token_ids:
            if self.state is None:
                return
            if t in self.end_ids:
                continue  # EOS under ignore_eos: the output text is unchanged
            self.state = self._next(self.state, t)

    def _next(self, state: Any, token_id: int) -> Any:
        data = self.table[token_id] if 0 <= token_id < len(self.table) else None
        if not data:
            return None
        return self.recognizer.advance(state, data)


def whitespace_ids(table: Sequence[bytes | None]) -> list[int]:
    """The token ids whose bytes are all JSON whitespace: what may follow a complete object."""
    return [i for i, data in enumerate(table) if data and _WS.issuperset(data)]


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """Each token id's bytes, None for special and added tokens (index = token id)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # byte-level BPE's alphabet

    vocab = len(tokenizer)
    pieces = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    special = set(getattr(tokenizer, "added_tokens_decoder", {})) | set(tokenizer.all_special_ids)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    byte_level = backend is not None and type(backend.decoder).__name__ == "ByteLevel"
    unicode_to_byte = {c: b for b, c in bytes_to_unicode().items()}
    table: list[bytes | None] = []
    for token_id, piece in enumerate(pieces):
        if token_id in special or not piece:
            table.append(None)
        elif byte_level:
            raw = [unicode_to_byte.get(c) for c in piece]
            table.append(None if None in raw else bytes(raw))  # type: ignore[arg-type]
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            table.append(bytes((int(piece[3:5], 16),)))  # SentencePiece byte fallback
        else:
            table.append(piece.replace("\u2581", " ").encode())
    return table

