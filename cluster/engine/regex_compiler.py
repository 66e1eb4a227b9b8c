"""Regular expressions for structured outputs, compiled: pattern → Thompson NFA over code
points (regex.py runs it). The syntax accepted, and what is refused, is in regex.py's docstring.

    compile_pattern(pattern) → (Nfa, start, accept)      RegexError names what is refused, and where
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_PATTERN_CHARS = 16384
MAX_REPEAT = 1000
MAX_STATES = 20000
MAX_CP = 0x10FFFF

Ranges = tuple[tuple[int, int], ...]  # sorted, disjoint, inclusive code point ranges


class RegexError(ValueError):
    """The pattern uses something this recognizer does not enforce, or is malformed."""


def _ranges(*pairs: tuple[int, int]) -> Ranges:
    out: list[list[int]] = []
    for lo, hi in sorted(pairs):
        if out and lo <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple((lo, hi) for lo, hi in out)


def _negate(r: Ranges) -> Ranges:
    out, nxt = [], 0
    for lo, hi in r:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CP:
        out.append((nxt, MAX_CP))
    return tuple(out)


_DIGIT = _ranges((48, 57))
_WORD = _ranges((48, 57), (65, 90), (95, 95), (97, 122))
_SPACE = _ranges((9, 13), (32, 32))
_CLASS_ESCAPES = {"d": _DIGIT, "w": _WORD, "s": _SPACE,
                  "D": _negate(_DIGIT), "W": _negate(_WORD), "S": _negate(_SPACE)}
_CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "f": "\f", "v": "\v", "a": "\a", "0": "\0"}
_ANY_BUT_NEWLINE = _negate(_ranges((10, 10)))
_COUNT = re.compile(r"\{(\d+)(,(\d*))?\}")


def choice_pattern(choices: list[str]) -> str:
    """The pattern whose matches are exactly `choices` (vLLM's `choice`)."""
    return "(?:" + "|".join(re.escape(c) for c in choices) + ")"


# Nodes: ("set", Ranges) · ("cat", [nodes]) · ("alt", [nodes]) · ("rep", node, min, max | None)
class _Parser:
    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0

    def fail(self, what: str, at: int | None = None) -> RegexError:
        return RegexError(f"regex: {what} at position {self.i if at is None else at}")

    def parse(self) -> tuple:
        self.end = len(self.p)
        if self.p.startswith("^"):
            self.i = 1
        if self.p.endswith("$") and self.end > self.i:
            slashes = len(self.p[:-1]) - len(self.p[:-1].rstrip("\\"))
            self.end -= slashes % 2 == 0  # an escaped $ is a literal
        node = self._alt()
        if self.i < self.end:
            raise self.fail("unbalanced ')'")
        return node

    def _peek(self) -> str | None:
        return self.p[self.i] if self.i < self.end else None

    def _alt(self) -> tuple:
        branches = [self._cat()]
        while self._peek() == "|":
            self.i += 1
            branches.append(self._cat())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def _cat(self) -> tuple:
        items = []
        while self._peek() not in (None, "|", ")"):
            items.append(self._repeat(self._atom()))
        return ("cat", items)

    def _repeat(self, atom: tuple) -> tuple:
        while True:
            c, start = self._peek(), self.i
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and (m := _COUNT.match(self.p, self.i, self.end)):
                lo = int(m.group(1))
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                if lo > MAX_REPEAT or (hi is not None and (hi > MAX_REPEAT or hi < lo)):
                    raise self.fail(f"a count over {MAX_REPEAT} or a reversed range", start)
                self.i = m.end()
            else:
                return atom
            if self._peek() == "?":  # lazy: the same language
                self.i += 1
            elif self._peek() == "+":
                raise self.fail("a possessive quantifier")
            if atom[0] == "rep":
                raise self.fail("a repeated quantifier (group it first)", start)
            atom = ("rep", atom, lo, hi)

    def _atom(self) -> tuple:
        c = self.p[self.i]
        self.i += 1
        if c == "(":
            if self.p.startswith("?:", self.i):
                self.i += 2
            elif self.p.startswith("?P<", self.i) or (self.p.startswith("?<", self.i)
                                                       and self.p[self.i + 2:self.i + 3] not in ("=", "!")):
                close = self.p.find(">", self.i)
                if close < 0 or not self.p[self.p.index("<", self.i) + 1:close].isidentifier():
                    raise self.fail("a malformed group name")
                self.i = close + 1
            elif self._peek() == "?":
                raise self.fail("lookaround, flags and other (?...) groups are not supported")
            node = self._alt()
            if self._peek() != ")":
                raise self.fail("missing ')'")
            self.i += 1
            return ("cat", [node])  # a group: its own quantifier may follow
        if c in "*+?":
            raise self.fail("nothing to repeat", self.i - 1)
        if c in "^$":
            raise self.fail("anchors are accepted only at the pattern's ends", self.i - 1)
        if c in ".[":
            return ("set", _ANY_BUT_NEWLINE if c == "." else self._class())
        return ("set", self._escape(in_class=False) if c == "\\" else ((ord(c), ord(c)),))

    def _escape(self, in_class: bool) -> Ranges:
        if self.i >= self.end:
            raise self.fail("a trailing backslash")
        c = self.p[self.i]
        self.i += 1
        if c in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[c]
        if c in _CHAR_ESCAPES:
            return ((ord(_CHAR_ESCAPES[c]),) * 2,)
        if c == "b" and in_class:
            return ((8, 8),)
        if c in "xuU":
            digits = {"x": 2, "u": 4, "U": 8}[c]
            text = self.p[self.i:self.i + digits]
            if len(text) != digits or not all(h in "0123456789abcdefABCDEF" for h in text) or int(text, 16) > MAX_CP:
                raise self.fail(f"a malformed \\{c} escape")
            self.i += digits
            return ((int(text, 16),) * 2,)
        if c.isdigit():
            raise self.fail("backreferences are not supported", self.i - 2)
        if c.isalnum():
            raise self.fail(f"\\{c} (anchors, word boundaries and unknown escapes) is not supported", self.i - 2)
        return ((ord(c), ord(c)),)

    def _class(self) -> Ranges:
        start = self.i - 1
        negate = self._peek() == "^"
        self.i += negate
        pairs: list[tuple[int, int]] = []
        first = True
        while True:
            c = self._peek()
            if c is None:
                raise self.fail("an unterminated character class", start)
            if c == "]" and not first:
                self.i += 1
                break
            first, at = False, self.i
            lo = self._class_item()
            if isinstance(lo, tuple):  # \d and friends: no ranges from them
                pairs.extend(lo)
                continue
            if self._peek() == "-" and self.i + 1 < self.end and self.p[self.i + 1] != "]":
                self.i += 1
                hi = self._class_item()
                if isinstance(hi, tuple) or hi < lo:
                    raise self.fail("a bad range in a character class", at)
                pairs.append((lo, hi))
            else:
                pairs.append((lo, lo))
        r = _ranges(*pairs)
        return _negate(r) if negate else r

    def _class_item(self) -> int | Ranges:
        c = self.p[self.i]
        self.i += 1
        if c != "\\":
            return ord(c)
        r = self._escape(in_class=True)
        return r[0][0] if len(r) == 1 and r[0][0] == r[0][1] else r


@dataclass
class Nfa:
    eps: list[list[int]]
    edges: list[list[tuple[Ranges, int]]]

    def new(self) -> int:
        if len(self.eps) >= MAX_STATES:
            raise RegexError(f"regex: the pattern compiles to more than {MAX_STATES} states")
        self.eps.append([])
        self.edges.append([])
        return len(self.eps) - 1

    def build(self, node: tuple) -> tuple[int, int]:
        """The fragment (start, end) matching `node`; ε-edges join fragments."""
        kind, s = node[0], self.new()
        if kind == "set":
            e = self.new()
            self.edges[s].append((node[1], e))
            return s, e
        if kind == "cat":
            e = s
            for child in node[1]:
                e = self._then(e, child)
            return s, e
        end = self.new()
        if kind == "alt":
            for child in node[1]:
                self.eps[self._then(s, child)].append(end)
            return s, end
        _, child, lo, hi = node
        e = s
        for _ in range(lo):  # the required copies
            e = self._then(e, child)
        self.eps[e].append(end)
        if hi is None:  # then a loop
            cs, ce = self.build(child)
            self.eps[e].append(cs)
            self.eps[ce] += [cs, end]
        for _ in range((hi or lo) - lo):  # or up to hi - lo more, each able to stop
            e = self._then(e, child)
            self.eps[e].append(end)
        return s, end

    def _then(self, e: int, node: tuple) -> int:
        """`node` after state `e`; returns its end."""
        cs, ce = self.build(node)
        self.eps[e].append(cs)
        return ce


def compile_pattern(pattern: str) -> tuple[Nfa, int, int]:
    """The NFA of `pattern` (matched whole), its start state and its one accepting state."""
    if not isinstance(pattern, str) or not pattern:
        raise RegexError("regex: must be a non-empty string")
    if len(pattern) > MAX_PATTERN_CHARS:
        raise RegexError(f"regex: longer than {MAX_PATTERN_CHARS} characters")
    nfa = Nfa([], [])
    start, accept = nfa.build(_Parser(pattern).parse())
    return nfa, start, accept
