"""The structured-output backend's contract (cluster/engine/structured/base.py) on xgrammar and the
default model's tokenizer, the engine's per-request Constraint around it, and the sampler that
applies its masks: a mask allows exactly the tokens that continue a valid reply, rollback restores
the state, the end is allowed exactly when the reply is complete, speculative rows advance one
draft each, and whatever is sampled is checked by jsonschema and re, not by our own code."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from cluster.engine.sampler import sample, unpack_bitmask
from cluster.engine.structured.constraint import Constraint
from cluster.engine.structured.registry import create_backend
from cluster.sampling_params import SamplingParams
from cluster.structured_output import StructuredOutput
from test_structured_checks import ENFORCED

OPTIONS = ["red", "green (light)", "1+1"]
CODE = {"type": "object", "additionalProperties": False, "required": ["code", "n", "day"],
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                       "n": {"type": "integer", "minimum": 100, "maximum": 120},
                       "day": {"type": "string", "format": "date"}}}
GRAMMAR = 'root ::= ("yes" | "no") ", " [0-9]{1,3}'
GRAMMAR_AS_REGEX = r"(yes|no), [0-9]{1,3}"


@pytest.fixture(scope="module")
def tok(default_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_path))


@pytest.fixture(scope="module")
def backend(tok):
    return create_backend("xgrammar", tok, len(tok), [tok.eos_token_id])


def allowed(matcher, vocab: int) -> set[int]:
    bitmask = torch.zeros(1, -(-vocab // 32), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return set(unpack_bitmask(bitmask, vocab)[0].nonzero().flatten().tolist())


def constraint(backend, tok, spec: StructuredOutput, replay=()) -> Constraint:
    return Constraint(backend.matcher(backend.compile(spec)), {tok.eos_token_id}, replay, backend.trailing_ids)


def test_a_choice_mask_allows_exactly_the_tokens_that_begin_an_option_and_the_end_only_after_one(backend, tok):
    m = backend.matcher(backend.compile(StructuredOutput.choices(OPTIONS)))
    texts = [tok.decode([t]) for t in range(len(tok))]
    expected = {t for t, s in enumerate(texts) if s and any(o.startswith(s) for o in OPTIONS)}
    assert allowed(m, len(tok)) == expected and not m.may_end()
    for t in tok.encode("red", add_special_tokens=False):
        assert m.accept(t)
    assert m.may_end() and allowed(m, len(tok)) == {tok.eos_token_id}
    assert not m.accept(tok.encode("x", add_special_tokens=False)[0])  # refused, and nothing changed
    assert m.may_end()


def test_a_regex_that_may_go_on_allows_the_end_beside_what_continues_it(backend, tok):
    m = backend.matcher(backend.compile(StructuredOutput("regex", "[0-9]{2,3}")))
    digit = {t for t in range(len(tok)) if re.fullmatch(r"[0-9]+", tok.decode([t]))}
    for t in tok.encode("12", add_special_tokens=False):
        assert m.accept(t)
    ends = allowed(m, len(tok))
    assert m.may_end() and tok.eos_token_id in ends and ends - {tok.eos_token_id} == {
        t for t in digit if len(tok.decode([t])) == 1}


def test_rollback_restores_the_mask_of_every_earlier_position(backend, tok):
    m = backend.matcher(backend.compile(StructuredOutput.schema(CODE)))
    ids = tok.encode(json.dumps({"code": "AB12", "n": 107, "day": "2024-02-29"}), add_special_tokens=False)
    masks = []
    for t in ids:
        masks.append(allowed(m, len(tok)))
        assert m.accept(t)
    assert m.may_end()
    for back in (1, 3, len(ids) - 2):
        m.rollback(back)
        assert allowed(m, len(tok)) == masks[len(ids) - back] and not m.may_end()
        for t in ids[len(ids) - back:]:
            assert m.accept(t)


def test_every_keyword_the_checks_let_through_compiles(backend):
    backend.compile(StructuredOutput.schema(ENFORCED))


def test_a_resumed_request_is_where_a_fresh_one_is_after_the_same_tokens_and_a_cut_rolls_back(backend, tok):
    spec = StructuredOutput.schema(CODE)
    ids = tok.encode('{"code": "AB12", "n": 1', add_special_tokens=False)
    resumed = constraint(backend, tok, spec, replay=ids[:4])
    fresh = constraint(backend, tok, spec)
    fresh.sync(ids[:4])
    resumed.sync(ids[4:])  # the replayed prefix is not part of the output
    fresh.sync(ids)
    assert allowed(resumed.matcher, len(tok)) == allowed(fresh.matcher, len(tok))
    before = allowed(fresh.matcher, len(tok))
    fresh.sync(ids + tok.encode("0", add_special_tokens=False))
    fresh.sync(ids)  # a stop string cut the last token
    assert allowed(fresh.matcher, len(tok)) == before


def test_drafts_advance_one_row_each_and_are_undone_and_the_cut_is_at_the_first_refused_one(backend, tok):
    c = constraint(backend, tok, StructuredOutput("regex", "[a-z]+ [0-9]+"))
    out = tok.encode("abc", add_special_tokens=False)
    drafts = tok.encode(" 42", add_special_tokens=False) + tok.encode("x", add_special_tokens=False)
    c.sync(out)
    words = -(-len(tok) // 32)
    run = torch.full((len(drafts) + 1, words), -1, dtype=torch.int32)
    c.fill(run, 0)
    for j, d in enumerate(drafts):
        c.push_draft(d)
        c.fill(run, j + 1)
    c.pop_drafts()
    for j in range(len(drafts)):  # each row: what a fresh constraint allows after out + drafts[:j]
        ref = constraint(backend, tok, StructuredOutput("regex", "[a-z]+ [0-9]+"))
        ref.sync(out + drafts[:j])
        one = torch.full((1, words), -1, dtype=torch.int32)
        ref.fill(one, 0)
        assert torch.equal(run[j], one[0]), j
    assert c.accepted_prefix(out, drafts) == len(drafts) - 1  # "x" after digits is refused
    assert allowed(c.matcher, len(tok)) == allowed(constraint(backend, tok, StructuredOutput("regex", "[a-z]+ [0-9]+"),
                                                              replay=out).matcher, len(tok))


def test_the_sampler_takes_the_best_allowed_token_ends_a_complete_reply_and_pads_under_min_tokens(backend, tok):
    vocab = len(tok)
    eos = tok.eos_token_id
    spec = StructuredOutput("json_object")
    brace = tok.encode("{", add_special_tokens=False)[0]
    logits = torch.zeros(2, vocab)
    logits[:, tok.encode("x", add_special_tokens=False)[0]] = 9.0  # best, never JSON
    logits[:, brace] = 5.0
    greedy = SamplingParams(temperature=0.0)
    picked = sample(logits, [greedy] * 2, [None] * 2, [[], []], [[], []], {eos},
                    [constraint(backend, tok, spec), None]).token_ids
    assert picked == [brace, tok.encode("x", add_special_tokens=False)[0]]
    done = tok.encode("{}", add_special_tokens=False)
    newline = tok.encode("\n", add_special_tokens=False)[0]
    logits = torch.zeros(1, vocab)
    logits[0, newline] = 8.0  # a weak model would pad with newlines up to max_tokens
    logits[0, eos] = -3.0
    for params in (greedy, SamplingParams(temperature=1.0, seed=1)):
        gen = None if params.greedy else torch.Generator().manual_seed(1)
        got = sample(logits.clone(), [params], [gen], [[]], [done], {eos}, [constraint(backend, tok, spec)]).token_ids
        assert got == [eos]
    held = constraint(backend, tok, spec)  # EOS held back by min_tokens: whitespace, and the reply stays JSON
    out = list(done)
    for _ in range(3):
        out += sample(logits.clone(), [SamplingParams(temperature=0.0, min_tokens=len(done) + 3)], [None], [[]], [out],
                      {eos}, [held]).token_ids
    assert out[len(done):] == [newline] * 3 and held.active
    assert sample(logits.clone(), [greedy], [None], [[]], [out], {eos}, [held]).token_ids == [eos]


@pytest.mark.parametrize("spec, valid", [
    (StructuredOutput.schema(CODE), lambda text: jsonschema.validate(json.loads(text), CODE) is None),
    (StructuredOutput("grammar", GRAMMAR), lambda text: re.fullmatch(GRAMMAR_AS_REGEX, text)),
], ids=["pattern-minimum-format", "ebnf-grammar"])
def test_random_walks_end_in_values_the_independent_checker_accepts(backend, tok, spec, valid):
    gen = torch.Generator().manual_seed(7)
    eos = tok.eos_token_id
    params = SamplingParams(temperature=1.0)
    for walk in range(4):
        c, out = constraint(backend, tok, spec), []
        while not out or out[-1] != eos:
            logits = torch.randn(1, len(tok), generator=gen) * 4
            logits[0, eos] = 30.0  # taken as soon as it is allowed
            out += sample(logits, [params], [gen], [[]], [out], {eos}, [c]).token_ids
            assert len(out) < 80, tok.decode(out)
        assert valid(tok.decode(out[:-1])), tok.decode(out)
