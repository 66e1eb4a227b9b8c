"""Sampling: greedy, filters, seeded reproducibility, penalties, min_tokens, logprobs."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.sampler import Logprob, greedy, sample
from cluster.sampling_params import SamplingParams

EOS = 3


def run(logits, params, *, generators=None, prompts=None, outputs=None, eos=(EOS,)):
    rows = logits.shape[0]
    params = params if isinstance(params, list) else [params] * rows
    return sample(logits, params, generators or [None] * rows, prompts or [[]] * rows,
                  outputs or [[]] * rows, eos)


def random_logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def draws(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000, seed: int = 0) -> torch.Tensor:
    """n samples of one distribution: n identical rows sharing one generator."""
    logits = logits_row.expand(n, -1).contiguous()
    gen = torch.Generator().manual_seed(seed)
    return torch.tensor(run(logits, params, generators=[gen] * n).token_ids)


def test_greedy_is_argmax_and_leaves_logits_untouched():
    logits = random_logits(16, 1000)
    before = logits.clone()
    result = run(logits, SamplingParams(temperature=0))
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 16
    assert torch.equal(logits, before)


@pytest.mark.parametrize("vocab", [49152, 32000, 50257, 130, 200, 127, 1])
def test_greedy_picks_the_first_maximum_like_argmax_in_every_row(vocab):
    """A row's token under temperature 0 is torch's argmax: the first of tied maxima (here in
    another span than a later tie, or in the tail past the last whole span), a NaN over any
    number, an all -inf row's first index."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g)
    ties = torch.randint(0, vocab, (4,), generator=g).sort().values
    logits[1, ties] = 50.0  # tied maxima: the first one wins
    logits[2, -1] = 50.0  # the last token (the tail when the vocab is not whole spans)
    logits[3, [vocab // 2, -1]] = 50.0  # tied between a span and the tail: the span's
    logits[4, vocab // 3] = float("nan")
    logits[5] = float("-inf")
    logits[6, [0, -1]] = float("nan")
    logits[7, -1] = float("nan")
    want = torch.argmax(logits, dim=-1)
    assert greedy(logits).tolist() == want.tolist()
    assert greedy(logits[:1]).tolist() == want[:1].tolist()


@pytest.mark.parametrize("params", [SamplingParams(top_k=1), SamplingParams(top_p=1e-6),
                                    SamplingParams(min_p=1.0), SamplingParams(temperature=1e-4)])
def test_narrow_filters_reduce_to_greedy(params):
    logits = random_logits(32, 500, seed=1)
    gen = torch.Generator().manual_seed(0)
    assert run(logits, params, generators=[gen] * 32).token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = random_logits(6, 300, seed=2)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5)] * 3
    tokens = run(logits, params).token_ids
    assert tokens[0::2] == logits[0::2].argmax(-1).tolist()


def seeded_sequence(seed: int, position: int, others: list[SamplingParams], steps: int = 20) -> list[int]:
    """Tokens a seeded row draws over `steps` steps, placed at `position` among other rows."""
    vocab = 1000
    gen = torch.Generator().manual_seed(seed)
    other_gen = torch.Generator().manual_seed(1234 + position)
    params = list(others)
    params.insert(position, SamplingParams(temperature=1.0, top_p=0.95, seed=seed))
    gens = [other_gen if p.seed is None else torch.Generator().manual_seed(99) for p in others]
    gens.insert(position, gen)
    out = []
    for step in range(steps):
        logits = random_logits(len(params), vocab, seed=1000 + step + 7 * position, scale=0.5)
        logits[position] = random_logits(1, vocab, seed=step, scale=0.5)[0]
        out.append(run(logits, params, generators=gens).token_ids[position])
    return out


def test_seeded_sampling_ignores_batch_position_and_other_rows():
    alone = seeded_sequence(7, 0, [])
    in_batch = seeded_sequence(7, 2, [SamplingParams(temperature=0.8), SamplingParams(temperature=0),
                                      SamplingParams(top_k=5, seed=3), SamplingParams(min_p=0.1)])
    assert alone == in_batch
    assert seeded_sequence(8, 0, []) != alone


def test_temperature_frequencies_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    for temperature in (0.5, 1.0, 2.0):
        samples = draws(logits, SamplingParams(temperature=temperature), n=8000)
        freq = torch.bincount(samples, minlength=5).float() / len(samples)
        expected = torch.softmax(logits / temperature, dim=-1)
        assert torch.allclose(freq, expected, atol=0.02), (temperature, freq, expected)


@pytest.mark.parametrize("u", [0.0, 1 - 2 ** -24])  # uniform_'s lowest and highest float32 draws
def test_draws_at_either_end_of_their_range_land_on_allowed_tokens(monkeypatch, u):
    """One uniform per row picks the token (the inverse of the running probability): a draw of
    0 must not pick a masked first token, the highest must not step past the last allowed one."""
    from cluster.engine import sampler

    logits = torch.full((64, 1000), float("-inf"))
    logits[:, 3:10] = random_logits(64, 7, seed=5)
    monkeypatch.setattr(sampler, "_uniforms", lambda n, like, gens: torch.full((n, 1), u))
    tokens = run(logits, SamplingParams(temperature=1.0)).token_ids
    assert tokens == [3 if u == 0 else 9] * 64


@pytest.mark.parametrize("params, allowed", [
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.7), {0, 1}),  # 0.5 + 0.3 covers 0.7
    (SamplingParams(top_p=0.75, top_k=3), {0, 1}),
    (SamplingParams(min_p=0.5), {0, 1}),  # needs prob >= 0.25
    (SamplingParams(min_p=0.25), {0, 1, 2}),  # needs prob >= 0.125
])
def test_filters_keep_exactly_the_allowed_tokens(params, allowed):
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(draws(logits, params).tolist()) == allowed


def nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    probs, ids = logits.softmax(-1).sort(descending=True)
    return set(ids[(probs.cumsum(-1) - probs) < top_p].tolist())


@pytest.mark.parametrize("scale", [4.0, 0.05])  # peaked: few candidates; flat: wider than any shortlist
def test_top_p_samples_only_from_the_nucleus_over_a_large_vocab(scale):
    logits = random_logits(1, 6000, seed=3, scale=scale)[0]
    allowed = nucleus(logits, 0.9)
    samples = set(draws(logits, SamplingParams(top_p=0.9), n=2000).tolist())
    assert samples <= allowed
    assert len(samples) > min(len(allowed), 2000) // 4  # and not just its head


def test_rows_without_top_p_keep_the_whole_vocab_beside_rows_with_it():
    logits = random_logits(1, 6000, seed=4, scale=0.05).expand(400, -1).contiguous()
    params = [SamplingParams(top_p=0.01), SamplingParams()] * 200
    tokens = torch.tensor(run(logits, params, generators=[torch.Generator().manual_seed(0)] * 400).token_ids)
    head = set(logits[0].topk(256).indices.tolist())
    assert set(tokens[0::2].tolist()) <= nucleus(logits[0], 0.01)
    assert sum(t not in head for t in tokens[1::2].tolist()) > 100


def greedy_after(logits: torch.Tensor, prompt: list[int], output: list[int], **penalties) -> int:
    params = SamplingParams(temperature=0, **penalties)
    return run(logits.unsqueeze(0), [params], prompts=[prompt], outputs=[output]).token_ids[0]


@pytest.mark.parametrize("penalties, flips", [
    ({"frequency_penalty": 0.24}, False),  # 3.0 - 2 * 0.24 = 2.52 > 2.5
    ({"frequency_penalty": 0.26}, True),  # 3.0 - 2 * 0.26 = 2.48 < 2.5
    ({"presence_penalty": 0.49}, False),  # once, however often it occurred
    ({"presence_penalty": 0.51}, True),
    ({"repetition_penalty": 1.19}, False),  # 3.0 / 1.19 = 2.52
    ({"repetition_penalty": 1.21}, True),  # 3.0 / 1.21 = 2.48
])
def test_penalties_lower_seen_positive_logits_by_the_right_amount(penalties, flips):
    logits = torch.tensor([0.0, 1.0, 3.0, -5.0, 2.5, 0.0])
    assert greedy_after(logits, [1], [2, 5, 2], **penalties) == (4 if flips else 2)


def test_repetition_penalty_multiplies_negative_logits_and_covers_the_prompt():
    logits = torch.tensor([-1.0, -1.15, -4.0, -9.0])
    assert greedy_after(logits, [0], [], repetition_penalty=1.1) == 0  # -1.1 > -1.15
    assert greedy_after(logits, [0], [], repetition_penalty=1.2) == 1  # -1.2 < -1.15


def test_frequency_and_presence_penalties_ignore_the_prompt():
    logits = torch.tensor([0.0, 3.0, 2.5])
    assert greedy_after(logits, [1, 1, 1], [], frequency_penalty=2.0, presence_penalty=2.0) == 1


def test_penalties_only_touch_their_own_row():
    logits = torch.tensor([[0.0, 3.0, 2.5]] * 2)
    params = [SamplingParams(temperature=0, presence_penalty=1.0), SamplingParams(temperature=0)]
    assert run(logits, params, outputs=[[1], [1]]).token_ids == [2, 1]


def test_min_tokens_blocks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0, 3.0, 7.0]])  # EOS=3 best, then stop token 5
    params = [SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(5,))]
    assert run(logits, params, outputs=[[1]]).token_ids == [2]
    assert run(logits, params, outputs=[[1, 1]]).token_ids == [EOS]
    ignoring = [SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)]
    assert run(logits, ignoring, outputs=[[]]).token_ids == [5]


def test_logprobs_come_from_raw_logits_with_sorted_alternatives():
    logits = random_logits(3, 200, seed=5)
    params = [SamplingParams(temperature=0.7, top_k=10, repetition_penalty=1.5, logprobs=4),
              SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=0)]
    result = run(logits, params, outputs=[[int(logits[0].argmax())], [], []])
    raw = torch.log_softmax(logits, dim=-1)
    assert result.logprobs[1] is None
    sampled, top, rank = result.logprobs[0]
    assert sampled == Logprob(result.token_ids[0], pytest.approx(raw[0, result.token_ids[0]].item()))
    assert rank == 1 + int((raw[0] > raw[0, result.token_ids[0]]).sum())  # its place in the vocabulary
    values, ids = raw[0].topk(4)
    assert [t for t, _ in top] == ids.tolist()
    assert [lp for _, lp in top] == pytest.approx(values.tolist())
    assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
    assert result.logprobs[2] == (Logprob(int(logits[2].argmax()), pytest.approx(raw[2].max().item())), [], 1)


def test_out_of_vocab_stop_token_ids_are_ignored():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])
    params = [SamplingParams(temperature=0, min_tokens=1, stop_token_ids=(50_000,))]
    assert run(logits, params).token_ids == [2]


def test_logit_bias_bans_and_forces_tokens_in_its_own_row_only():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, 3.0]] * 3)
    params = [SamplingParams(temperature=0, logit_bias={2: -100}),      # the argmax, banned
              SamplingParams(temperature=0, logit_bias={0: 100, 50_000: 5}),  # forced; out of vocab ignored
              SamplingParams(temperature=0, logprobs=1)]
    result = run(logits, params)
    assert result.token_ids == [4, 0, 2]
    raw = torch.log_softmax(logits[2], dim=-1)  # logprobs stay those of the raw logits
    assert result.logprobs[2][0] == Logprob(2, pytest.approx(raw[2].item()))


def test_logit_bias_shifts_sampling_frequencies_like_added_logits():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5])
    bias = {1: 1.5, 3: -2.0}
    got = torch.bincount(draws(logits, SamplingParams(temperature=1.0, logit_bias=bias), n=20000), minlength=4)
    want = torch.softmax(logits + torch.tensor([0.0, 1.5, 0.0, -2.0]), dim=-1)
    assert (got / got.sum() - want).abs().max() < 0.015


@pytest.mark.parametrize("bias, message", [
    ({1: 100.5}, "values must be numbers in [-100, 100]"),
    ({1: float("nan")}, "values must be numbers in [-100, 100]"),
    ({-1: 1.0}, "keys must be token ids"),
    ({i: 1.0 for i in range(301)}, "at most 300 tokens"),
    (((4, 1.0), (4, 2.0)), "more than once"),
])
def test_logit_bias_is_validated(bias, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(logit_bias=bias)


def test_allowed_token_ids_are_all_a_row_may_sample_and_other_rows_keep_the_vocab():
    logits = random_logits(2, 500, seed=4)
    allowed = (7, 99, 250)
    params = [SamplingParams(temperature=1.0, allowed_token_ids=allowed), SamplingParams(temperature=1.0)]
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    picked = [run(logits, params, generators=gens).token_ids for _ in range(300)]
    assert {row[0] for row in picked} <= set(allowed) and len({row[0] for row in picked}) > 1
    assert len({row[1] for row in picked} - set(allowed)) > 10
    greedy = run(logits[:1], SamplingParams(temperature=0, allowed_token_ids=allowed)).token_ids[0]
    assert greedy == max(allowed, key=lambda t: logits[0, t].item())


def test_a_bad_word_bans_its_last_token_only_after_the_tokens_before_it():
    logits = torch.zeros(1, 50)
    logits[0, 10] = 5.0  # the favourite, then 11, then 12
    logits[0, 11] = 4.0
    logits[0, 12] = 3.0
    word = SamplingParams(temperature=0, bad_words_token_ids=((20, 21, 10), (11,)))
    assert run(logits, word, outputs=[[5, 20]]).token_ids == [10]  # output ends with 20, not 20 21
    assert run(logits, word, outputs=[[20, 21]]).token_ids == [12]  # 10 banned after 20 21; 11 always
    assert run(logits, word, outputs=[[21]]).token_ids == [10]  # a shorter tail never matches a longer prefix
    assert run(logits, word).token_ids == [10]
