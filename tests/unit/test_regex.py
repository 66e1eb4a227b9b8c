"""The regex recognizer behind structured_outputs regex and choice (engine/regex.py): it accepts
exactly the strings Python's re.fullmatch accepts, byte by byte, and refuses what it cannot
enforce with the construct's position."""

from __future__ import annotations

import random
import re

import pytest

from cluster.engine.json_mode import JsonConstraint
from cluster.engine.regex import RegexError, choice_pattern, regex_recognizer
from cluster.sampling_params import SamplingParams


def matches(pattern: str, text: str) -> bool:
    r = regex_recognizer(pattern)
    state = r.advance(r.START, text.encode())
    return state is not None and r.can_end(state)


PATTERNS = [r"\d+", r"[a-z]{2,4}@[a-z]+\.com", r"(ab|cd)*e?", r"(?:yes|no|maybe)", r"[^a\n]*", r".{3}",
            r"^[ab]+ [0-9]$", r"(a|b)*a(a|b){3}", r"[\x41-\x43]+\u00e9?", r"x{0,2}y{2,}",
            r"(?P<octet>[0-9]{1,3}\.){3}[0-9]{1,3}", r"é+[à-ü]?", r"a\$", r"[]a]+", r"[a-]+", r"\[\]", r"(a*)*b",
            r"()*a", r"a{2}?", r"[\d\s]+", r"(?:中|文)+.?", r"a+?b*?"]
ALPHABET = "abcdeyonsm@.01239 \nxyé\u00e0ü$[]-AB中文"


@pytest.mark.parametrize("pattern", PATTERNS)
def test_accepts_what_python_fullmatch_accepts(pattern):
    rng = random.Random(pattern)
    compiled = re.compile(pattern)
    strings = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8))) for _ in range(1500)]
    strings += ["abc", "12", "ab@cd.com", "abcde", "yes", "192.168.0.1", "ééà", "a$", "b", "a", "aa", "xyy", "中文x"]
    for s in strings:
        assert matches(pattern, s) == bool(compiled.fullmatch(s)), (pattern, s)


def test_fed_a_byte_at_a_time_it_reaches_the_same_state_as_whole_tokens():
    r = regex_recognizer(r"(ab|ç)*\u4e2d?é{1,2}")
    rng = random.Random(3)
    for _ in range(500):
        data = "".join(rng.choice("abçé中x") for _ in range(rng.randint(0, 6))).encode()
        whole = r.advance(r.START, data)
        state = r.START
        for i in range(len(data)):
            state = r.advance(state, data[i:i + 1])
            if state is None:
                break
        assert state == whole


def test_a_token_ending_inside_a_character_is_allowed_only_if_the_character_can_match():
    letters = regex_recognizer(r"[a-z]+")
    assert letters.advance(letters.START, "é".encode()[:1]) is None  # no é in [a-z]
    accented = regex_recognizer(r"[a-zé]+")
    half = accented.advance(accented.START, "é".encode()[:1])
    assert half is not None and not accented.can_end(half)  # mid-character: not a match yet
    assert accented.advance(half, "è".encode()[1:]) is None and accented.can_end(accented.advance(half, b"\xa9"))
    anything = regex_recognizer(r".+")
    for bad in (b"\xc0\x80", b"\xe0\x80", b"\xed\xa0", b"\xff", b"\x80", b"\xc3\x28"):  # overlong, surrogate, stray
        assert anything.advance(anything.START, bad) is None, bad


def test_choice_matches_exactly_its_options_metacharacters_included():
    options = ["Paris", "a.b", "(x)", "1+1", "C:\\dir", "What?", "naïve", "[ok]"]
    pattern = choice_pattern(options)
    for o in options:
        assert matches(pattern, o)
    for other in ["Pari", "Parisx", "axb", "x", "11", "What", "naive", "ok", ""]:
        assert not matches(pattern, other)


def test_a_match_that_may_go_on_allows_the_end_but_does_not_force_it():
    r = regex_recognizer(r"\d+")
    state = r.advance(r.START, b"42")
    assert r.can_end(state) and not r.is_complete(state)
    done = regex_recognizer(choice_pattern(["yes", "no"]))
    assert done.is_complete(done.advance(done.START, b"yes"))
    assert not done.can_end(done.advance(done.START, b"ye"))

    eos = 0
    table = [None, b"4", b"2", b"x", b"42"]
    digits = JsonConstraint(table, {eos}, recognizer=r)
    assert not digits.allows(eos) and digits.allows(4) and not digits.allows(3)  # nothing yet: no end
    digits.sync([4])
    assert digits.allows(eos) and digits.allows(1) and not digits.complete


@pytest.mark.parametrize("pattern, what, where", [
    (r"a(?=b)", "lookaround", 2), (r"(a)\1", "backreferences", 3), (r"\bword", "\\b", 0),
    (r"a++", "possessive", 2), (r"(?i)a", "flags", 1), (r"a**", "repeated quantifier", 2),
    ("a{2000}", "count over 1000", 1), ("(a", "missing ')'", 2), ("a)", "unbalanced ')'", 1),
    ("[a", "unterminated character class", 0), ("a^b", "anchors", 1), ("\\", "trailing backslash", 1),
    (r"\p{L}", "\\p", 0), ("*a", "nothing to repeat", 0), ("[z-a]", "bad range", 1),
])
def test_refuses_what_it_cannot_enforce_naming_it_and_where(pattern, what, where):
    with pytest.raises(RegexError) as info:
        regex_recognizer(pattern)
    assert what in str(info.value) and f"at position {where}" in str(info.value)


def test_a_pattern_too_big_to_compile_is_refused_before_it_is_built():
    with pytest.raises(RegexError, match="more than 20000 states"):
        regex_recognizer("((a{999}){999})")
    with pytest.raises(RegexError, match="longer than"):
        regex_recognizer("a" * 20000)


def test_sampling_params_take_a_regex_and_refuse_it_beside_json():
    assert SamplingParams(regex=r"\d+").regex == r"\d+"
    with pytest.raises(ValueError, match="backreferences"):
        SamplingParams(regex=r"(a)\1")
    with pytest.raises(ValueError, match="excludes json_object"):
        SamplingParams(regex="a", json_object=True)
