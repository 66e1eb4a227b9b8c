"""JSON mode: the recognizer agrees with json.loads, token bytes spell what the tokenizer
encodes, and the sampler's output under the constraint always parses."""

from __future__ import annotations

import json
import random

import torch

from cluster.engine.json_mode import MAX_DEPTH, JsonConstraint, JsonRecognizer, token_bytes
from cluster.engine.sampler import sample
from cluster.sampling_params import SamplingParams


def complete(text: str) -> bool:
    state = JsonRecognizer.advance(JsonRecognizer.START, text.encode())
    return state is not None and JsonRecognizer.is_complete(state)


def alive(text: str) -> bool:
    return JsonRecognizer.advance(JsonRecognizer.START, text.encode()) is not None


def random_value(rnd: random.Random, depth: int = 0):
    kind = rnd.randrange(7 if depth < 4 else 5)
    if kind == 0:
        return rnd.randrange(-10**6, 10**6)
    if kind == 1:
        return rnd.random() * 10 ** rnd.randrange(-8, 8)
    if kind == 2:
        return rnd.choice([True, False, None])
    if kind in (3, 4):
        return "".join(rnd.choice('ab"\\\n\t/é€😀 \x01') for _ in range(rnd.randrange(8)))
    if kind == 5:
        return [random_value(rnd, depth + 1) for _ in range(rnd.randrange(4))]
    return {f"k{i}": random_value(rnd, depth + 1) for i in range(rnd.randrange(4))}


def test_every_json_object_and_each_of_its_prefixes_is_recognized():
    rnd = random.Random(0)
    for _ in range(400):
        obj = {f"k{i}": random_value(rnd) for i in range(rnd.randrange(4))}
        for text in (json.dumps(obj), json.dumps(obj, indent=2),
                     json.dumps(obj, ensure_ascii=False, separators=(",", ":"))):
            data = text.encode()
            assert complete(text), text
            for cut in range(len(data)):  # a strict prefix goes on, and is not yet a whole object
                state = JsonRecognizer.advance(JsonRecognizer.START, data[:cut])
                assert state is not None and not JsonRecognizer.is_complete(state), (text, cut)


def test_a_one_character_edit_is_complete_exactly_when_json_loads_reads_an_object():
    rnd = random.Random(1)
    disagreements = []
    for _ in range(5000):
        text = json.dumps({"k": random_value(rnd)})
        at = rnd.randrange(len(text))
        edited = text[:at] + rnd.choice('{}[],:"\\0.e-+ atx\n') + text[at + 1:]
        try:
            is_object = isinstance(json.loads(edited), dict)
        except ValueError:
            is_object = False
        if complete(edited) != is_object:
            disagreements.append(edited)
    assert disagreements == []


def test_what_no_json_object_can_start_or_contain_is_refused():
    for text in ('[1]', '"a"', '1', 'x{', ' {', '\n{', '{"a" 1', '{"a": 01', '{"a": 1.}', '{"a": tru}', '{"a": "x\ny"}',
                 '{,', '{"a": 1,}', '{"a": [1,]', '{"a": "\\x"', '{}}', '{"a": 1]', '{"a": .5', '{}x', "{'a': 1}"):
        assert not alive(text), text
    assert complete('{"a": [1, 2.5e-3, -0, true, false, null, "\\u00e9\\n"], "b": {"c": {}}}\n')
    assert alive('{"a": ' + "[" * (MAX_DEPTH - 1)) and not alive('{"a": ' + "[" * MAX_DEPTH)
    assert alive('{"a": ' + "9" * 64) and not alive('{"a": ' + "9" * 65)
    assert alive("{" + " " * 64) and not alive("{" + " " * 65) and alive("{}" + " " * 1000)  # whitespace runs end; after the object it may pad


def test_token_bytes_spell_out_what_the_tokenizer_encodes(default_model_path):
    from cluster.engine.tokenizer import Tokenizer

    tok = Tokenizer(default_model_path)
    table = tok.token_table
    assert len(table) == tok.vocab_size
    for text in ('{"capital": "Paris", "n": [1, -2.5e3]}', " héllo wörld 😀\n\t{}", "  two  spaces"):
        assert b"".join(table[t] for t in tok.encode(text)) == text.encode()
    assert all(table[t] is None for t in tok.eos_token_ids)  # special tokens are never JSON text


# a small vocabulary: JSON pieces, two special tokens; EOS is the last id
PIECES = [b"{", b"}", b"[", b"]", b'"', b'"k"', b":", b",", b" ", b"\n", b"1", b"-", b".5", b"true", b"null",
          b"ab", b"\\n", b'{"', b'"}', b"x", b"e", None, None]
EOS = len(PIECES) - 1


def walk(rows: int, params: SamplingParams, steps: int, seed: int) -> list[list[int]]:
    """Sample `rows` sequences under JSON mode from random logits (EOS and closers favoured)."""
    gen = torch.Generator().manual_seed(seed)
    constraints = [JsonConstraint(PIECES, {EOS}) for _ in range(rows)]
    outs: list[list[int]] = [[] for _ in range(rows)]
    bias = torch.zeros(len(PIECES))
    bias[[1, 3, EOS]] = 2.0
    for _ in range(steps):
        live = [i for i in range(rows) if not outs[i] or outs[i][-1] != EOS]
        if not live:
            break
        logits = torch.randn(len(live), len(PIECES), generator=gen) * 3 + bias
        picked = sample(logits, [params] * len(live), [gen] * len(live), [[]] * len(live),
                        [outs[i] for i in live], {EOS}, [constraints[i] for i in live]).token_ids
        for i, t in zip(live, picked):
            outs[i].append(t)
    return outs


def text_of(ids: list[int]) -> str:
    return b"".join(PIECES[t] for t in ids if t != EOS).decode()


def test_sampled_outputs_parse_whenever_they_end_and_are_json_prefixes_otherwise():
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9, top_k=5),
                   SamplingParams(temperature=0.0)):
        outs = walk(32, params, 120, seed=3)
        ended = [o for o in outs if o[-1] == EOS]
        assert len(ended) >= 8, params  # the walks do end (EOS is favoured)
        for o in ended:
            assert EOS not in o[:-1] and isinstance(json.loads(text_of(o)), dict)
        for o in outs:
            assert alive(text_of(o)), text_of(o)
            assert all(PIECES[t] is not None for t in o if t != EOS)  # never the other special token


def test_greedy_takes_the_best_allowed_token_and_leaves_other_rows_alone():
    logits = torch.full((2, len(PIECES)), -5.0)
    logits[:, PIECES.index(b"x")] = 9.0  # best, never JSON
    logits[:, PIECES.index(b"[")] = 8.0  # second: not allowed first either
    logits[:, PIECES.index(b'{"')] = 7.0
    greedy = SamplingParams(temperature=0.0)
    picked = sample(logits, [greedy] * 2, [None] * 2, [[], []], [[], []], {EOS},
                    [JsonConstraint(PIECES, {EOS}), None]).token_ids
    assert picked == [PIECES.index(b'{"'), PIECES.index(b"x")]
    # a complete object: the reply ends there, even when whitespace scores far better (a weak
    # model would pad it with newlines up to max_tokens), sampled or greedy
    done = [PIECES.index(b"{"), PIECES.index(b"}")]
    logits = torch.full((1, len(PIECES)), 0.0)
    logits[0, EOS] = -3.0
    logits[0, PIECES.index(b",")] = 5.0
    logits[0, PIECES.index(b"\n")] = 4.0
    for params in (greedy, SamplingParams(temperature=1.0, seed=1)):
        gen = None if params.greedy else torch.Generator().manual_seed(1)
        got = sample(logits.clone(), [params], [gen], [[]], [done], {EOS}, [JsonConstraint(PIECES, {EOS})]).token_ids
        assert got == [EOS]


def test_a_resumed_request_continues_the_same_object():
    prior = [PIECES.index(b'{"'), PIECES.index(b"ab"), PIECES.index(b'"'), PIECES.index(b":")]
    resumed = JsonConstraint(PIECES, {EOS}, replay=prior)
    fresh = JsonConstraint(PIECES, {EOS})
    fresh.sync(prior)
    assert resumed.state == fresh.state and resumed.allows(PIECES.index(b"1"))
    assert not JsonConstraint(PIECES, {EOS}).allows(PIECES.index(b"1"))


def test_past_a_complete_object_min_tokens_pads_with_whitespace_from_a_shortlist():
    """EOS held back by min_tokens, no whitespace among the likeliest tokens: the row picks
    whitespace from the constraint's shortlist instead of asking about the whole vocabulary."""
    table = [b"{", b"}", b" ", b"\n", b" \n ", *[b"x%d" % i for i in range(6000)], None]
    eos = len(table) - 1
    asked = []

    class Counting(JsonConstraint):
        def allows(self, token_id: int) -> bool:
            asked.append(token_id)
            return super().allows(token_id)

    gen = torch.Generator().manual_seed(0)
    for temperature in (0.0, 0.0, 0.8, 0.8, 0.8):
        logits = torch.randn(1, len(table), generator=gen)
        logits[0, [2, 3, 4]] = torch.tensor([-20.0, -21.0, -19.0])  # whitespace, far below the rest
        params = SamplingParams(temperature=temperature, min_tokens=8)
        asked.clear()
        picked = sample(logits, [params], [gen], [[]], [[0, 1]], {eos}, [Counting(table, {eos})]).token_ids[0]
        assert picked in (2, 3, 4) and (temperature > 0 or picked == 4)
        assert len(asked) <= 256 + 4  # the first batch, then the shortlist: 3 tokens and EOS
