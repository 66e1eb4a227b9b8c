"""Structured outputs by regular expression (vLLM's `structured_outputs: {"regex": ...}`, and
`{"choice": [...]}` as an alternation of literals): a byte-level recognizer, torch-free.

    regex_recognizer(pattern) → RegexRecognizer     (RegexError names what is refused, and where)
    recognizer.advance(state, data) → state | None;  can_end(state);  is_complete(state)

The whole reply must match, as `re.fullmatch`: a leading `^` and a trailing `$` are accepted
and change nothing. Supported: literals (any Unicode, as UTF-8), `.` (any character but a
newline), classes `[...]` (ranges, negation, escapes), `\\d \\w \\s` and their negations
(ASCII, as xgrammar reads them: `\\d` is [0-9]), `\\n \\t \\r \\f \\v \\xhh \\uhhhh`, escaped
metacharacters, groups `(...)`, `(?:...)`, `(?P<name>...)`, `|`, and the quantifiers `* + ?
{m} {m,} {m,n}` (lazy ones too: only the language matters here, not which match Python's re
would pick). Refused, with the construct and its position: backreferences, lookaround, flags,
`\\b`, anchors inside the pattern, possessive quantifiers, counts over MAX_REPEAT and patterns
of more than MAX_STATES states (regex_compiler.py, which parses and compiles).

How: a Thompson NFA over code points, run as a DFA built lazily: a state is the set of NFA
states reached (plus the bytes of a code point not yet complete: a token may end inside a
multi-byte character), and the transitions met are cached per (set, code point).
"""

from __future__ import annotations

import bisect
import functools
import re

from cluster.engine.regex_compiler import MAX_CP, Ranges, RegexError, compile_pattern

MAX_CACHED_STATES = 1 << 21  # NFA state ids held by a pattern's transition cache, in all

State = tuple[frozenset[int], bytes]
__all__ = ["RegexError", "RegexRecognizer", "choice_pattern", "regex_recognizer"]


def choice_pattern(choices: list[str]) -> str:
    """The pattern whose matches are exactly `choices` (vLLM's `choice`)."""
    return "(?:" + "|".join(re.escape(c) for c in choices) + ")"


class RegexRecognizer:
    """One compiled pattern. States are (set of NFA states, pending bytes); the transitions
    met so far are cached, shared by every request using the pattern, and bounded."""

    def __init__(self, pattern: str) -> None:
        self.nfa, start, self.accept = compile_pattern(pattern)
        self._moves: dict[tuple[frozenset[int], int], frozenset[int] | None] = {}
        self._cached_size = 0
        self.START: State = (self._closure({start}), b"")

    def _closure(self, states: set[int]) -> frozenset[int]:
        todo, seen = list(states), set(states)
        while todo:
            for t in self.nfa.eps[todo.pop()]:
                if t not in seen:
                    seen.add(t)
                    todo.append(t)
        return frozenset(seen)

    def _move(self, states: frozenset[int], cp: int) -> frozenset[int] | None:
        key = (states, cp)
        if key in self._moves:
            return self._moves[key]
        targets = {t for s in states for r, t in self.nfa.edges[s] if _contains(r, cp)}
        nxt = self._closure(targets) if targets else None
        if self._cached_size > MAX_CACHED_STATES:
            self._moves.clear()
            self._cached_size = 0
        self._moves[key] = nxt
        self._cached_size += len(states) + len(nxt or ())
        return nxt

    def advance(self, state: State, data: bytes) -> State | None:
        """The state after `data`, or None when no match can continue with it."""
        states, pending = state
        for byte in data:
            if pending or byte >= 0x80:  # a multi-byte character: step once it is whole
                pending += bytes((byte,))
                span = _utf8_span(pending)
                if span is None or not any(_overlaps(r, *span) for s in states for r, _ in self.nfa.edges[s]):
                    return None
                if span[0] != span[1]:
                    continue
                cp, pending = span[0], b""
            else:
                cp = byte
            nxt = self._move(states, cp)
            if nxt is None:
                return None
            states = nxt
        return states, pending

    def can_end(self, state: State) -> bool:
        """The reply so far matches the whole pattern."""
        return not state[1] and self.accept in state[0]

    def is_complete(self, state: State) -> bool:
        """It matches, and nothing can follow: the reply must end here."""
        return self.can_end(state) and not any(self.nfa.edges[s] for s in state[0])


def _contains(r: Ranges, cp: int) -> bool:
    i = bisect.bisect_right(r, (cp, MAX_CP + 1)) - 1
    return i >= 0 and r[i][0] <= cp <= r[i][1]


def _overlaps(r: Ranges, lo: int, hi: int) -> bool:
    i = bisect.bisect_right(r, (hi, MAX_CP + 1)) - 1
    return i >= 0 and r[i][1] >= lo


_UTF8 = {2: (0xC2, 0xDF, 0x80, 0x7FF), 3: (0xE0, 0xEF, 0x800, 0xFFFF), 4: (0xF0, 0xF4, 0x10000, MAX_CP)}


def _utf8_span(prefix: bytes) -> tuple[int, int] | None:
    """The code points a UTF-8 sequence starting with `prefix` can still encode, as (lo, hi)
    (lo == hi once whole); None if no valid sequence starts so."""
    n = next((k for k, (first, last, _, _) in _UTF8.items() if first <= prefix[0] <= last), 0)
    if not n or len(prefix) > n or any(not 0x80 <= b <= 0xBF for b in prefix[1:]):
        return None
    value = prefix[0] & (0xFF >> (n + 1))
    for b in prefix[1:]:
        value = value << 6 | b & 0x3F
    rest = 6 * (n - len(prefix))
    lo, hi = max(value << rest, _UTF8[n][2]), min(value << rest | ((1 << rest) - 1), _UTF8[n][3])
    if lo > hi or 0xD800 <= lo <= hi <= 0xDFFF:  # overlong, or a surrogate
        return None
    return lo, hi


@functools.lru_cache(maxsize=64)
def regex_recognizer(pattern: str) -> RegexRecognizer:
    """The compiled recognizer for `pattern`, cached (requests reuse their patterns)."""
    return RegexRecognizer(pattern)
