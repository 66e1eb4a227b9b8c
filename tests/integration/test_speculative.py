"""Speculative decoding end to end in the engine (offline LLM), on the default model and tiny
random ones: the same tokens as without speculation, exact sampling, and what each proposer wins.

Engines here run float32 (`auto` is bf16 on a CPU where bf16 beats fp32): a verify step multiplies
several rows where decode multiplies one, and bf16's rounding of the activations turns the
kernels' different summation orders into logprobs 0.004 apart and, at near-ties, another token;
in fp32 the same paths agree to 1e-6, which is what lets these tests ask for the same tokens."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections import Counter

import pytest
import torch

from cluster import LLM, SamplingParams, StructuredOutput
from cluster.engine import sampler
from cluster.engine.spec.base import Proposer

TEXT = ("The lighthouse keeper climbed the spiral stairs at dusk, lit the great lamp, and wrote "
        "in his log that the sea was calm, the wind was from the west, and no ships had passed.")
SCHEMA = json.dumps({"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
                     "required": ["city", "population"]})
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


def chats(llm: LLM) -> list[list[int]]:
    tok = llm.engine.tokenizer
    return [tok.encode_chat([{"role": "user", "content": c}]) for c in (
        f"Repeat this text exactly, word for word:\n\n{TEXT}",
        "What is the capital of France? Tell me about it.",
        "Give the largest city of Japan and its population as JSON.",
        f"Rewrite this in the past perfect tense:\n\n{TEXT}",
    )]


def requests(llm: LLM) -> tuple[list[list[int]], list[SamplingParams]]:
    """One batch that covers what must keep working with speculation on."""
    p = chats(llm)
    return ([p[0], p[1], p[2], p[3], p[0], p[1]], [
        dataclasses.replace(GREEDY, logprobs=3),  # logprobs: the same values
        dataclasses.replace(GREEDY, stop=["Paris"], include_stop_str_in_output=True),
        dataclasses.replace(GREEDY, structured=StructuredOutput("json_schema", SCHEMA), max_tokens=40),
        dataclasses.replace(GREEDY, max_tokens=29, min_tokens=29, ignore_eos=True),  # cut inside a run
        SamplingParams(temperature=0.8, top_p=0.95, seed=11, n=2, max_tokens=32),  # seeded: same tokens
        SamplingParams(temperature=1.0, top_k=20, presence_penalty=0.5, seed=5, max_tokens=24),
    ])


def replies(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(default_model_path):
    llm = LLM(dtype="float32")
    prompts, params = requests(llm)
    return llm.generate(prompts, params)


@pytest.fixture(scope="module")
def tiny_draft(tiny_model_paths):
    return str(tiny_model_paths["llama"])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model: itself", "draft_model: tiny random"])
def test_the_same_tokens_with_speculation_for_every_method(method, reference, default_model_path, tiny_draft):
    spec = {"draft_model: itself": {"model": str(default_model_path)},
            "draft_model: tiny random": {"model": tiny_draft}}.get(method, {"method": method})
    llm = LLM(speculative_config={**spec, "num_speculative_tokens": 4}, dtype="float32")
    prompts, params = requests(llm)
    outs = llm.generate(prompts, params)
    assert replies(outs) == replies(reference)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in reference]
    assert outs[1].outputs[0].text.endswith("Paris") and outs[1].outputs[0].finish_reason == "stop"
    assert json.loads(outs[2].outputs[0].text)["city"]
    for got, want in zip(outs[0].outputs[0].logprobs, reference[0].outputs[0].logprobs):
        assert got.sampled.token_id == want.sampled.token_id
        assert got.sampled.logprob == pytest.approx(want.sampled.logprob, abs=2e-3)
        assert [t.token_id for t in got.top] == [t.token_id for t in want.top]
    stats = llm.engine.stats()
    assert stats["blocks_in_use"] == 0
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["generation_tokens"] == sum(len(c.token_ids) for o in outs for c in o.outputs)  # usage as without
    if method == "draft_model: tiny random":
        assert stats["spec_acceptance_rate"] < 0.2  # most drafts rejected, and the output unchanged
    else:
        assert stats["spec_num_accepted_tokens"] > 0


@pytest.mark.slow
def test_the_default_model_as_its_own_draft_has_every_greedy_draft_accepted(default_model_path):
    llm = LLM(speculative_config={"model": str(default_model_path), "num_speculative_tokens": 4, "adaptive": False}, dtype="float32")
    prompts = chats(llm)
    llm.generate(prompts, GREEDY)
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 100
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]  # its drafts are its own argmax
    assert stats["spec_accepted_pos_3"] > 0


@pytest.mark.slow
def test_input_grounded_replies_take_fewer_steps_with_ngram(default_model_path):
    """The point of it: a reply that copies its prompt needs far fewer forward passes."""
    plain, spec = LLM(dtype="float32"), LLM(speculative_config={"method": "ngram", "adaptive": False}, dtype="float32")
    prompt = chats(plain)[0]
    steps = []
    for llm in (plain, spec):
        rid = llm.engine.new_request_id()
        llm.engine.add_request(rid, prompt, dataclasses.replace(GREEDY, max_tokens=40, min_tokens=40))
        n = 0
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
            n += 1
        steps.append(n)
    assert steps[0] == 40 and steps[1] <= 20, steps


def test_preempted_speculating_requests_recompute_to_the_same_tokens(tiny_model_paths):
    """Under the priority policy too: its victims and order work on requests with drafts."""
    folder = str(tiny_model_paths["llama"])
    prompts = [[100 + 7 * i + j for j in range(10)] * 2 for i in range(6)]  # repeats: ngram drafts
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, priority=i % 3) for i in range(6)]
    engine = {"num_blocks": 20, "block_size": 8, "scheduling_policy": "priority"}
    plain = LLM(folder, **engine, dtype="float32").generate(prompts, params)
    llm = LLM(folder, **engine, speculative_config={"method": "ngram", "adaptive": False, "prompt_lookup_min": 1}, dtype="float32")
    outs = llm.generate(prompts, params)
    assert replies(outs) == replies(plain)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_draft_tokens"] > 0
    assert stats["blocks_in_use"] == 0


def test_constrained_replies_stay_exact_with_speculation_chunked_prefill_and_preemption(tiny_model_paths):
    """Each constrained row is masked from the state its drafts lead to, a preempted request's
    constraint stays where its output is, and prompts prefilled in chunks sample only at the end."""
    import re

    folder = str(tiny_model_paths["llama"])
    prompts = [[100 + 7 * i + j for j in range(10)] * 2 for i in range(6)]  # repeats: ngram drafts
    pattern = "[a-z]+( [a-z]+)*"  # unambiguous: xgrammar takes ~0.1 s per mask on an ambiguous one, ([a-z]+ ?)+
    specs = [StructuredOutput("regex", pattern), StructuredOutput("json_object"), None]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured=specs[i % 3]) for i in range(6)]
    plain = LLM(folder, dtype="float32")
    alone = [plain.generate([p], [q])[0] for p, q in zip(prompts[:3], params[:3])]  # one at a time
    engine = {"num_blocks": 20, "block_size": 8, "max_num_batched_tokens": 12}
    llm = LLM(folder, **engine, speculative_config={"method": "ngram", "adaptive": False, "prompt_lookup_min": 1}, dtype="float32")
    outs = llm.generate(prompts, params)
    assert replies(outs[:3]) == replies(alone)
    for i in (0, 3):
        assert re.fullmatch(pattern, outs[i].outputs[0].text), outs[i].outputs[0].text
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_num_draft_tokens"] > 0 and stats["blocks_in_use"] == 0


def test_prompt_logprobs_are_unchanged_with_speculation(tiny_model_paths):
    folder = str(tiny_model_paths["llama"])
    prompt = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2, ignore_eos=True)
    want = LLM(folder, dtype="float32").generate(prompt, params)[0]
    got = LLM(folder, speculative_config={"method": "ngram", "prompt_lookup_min": 1}, dtype="float32").generate(prompt, params)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert [e and e.sampled for e in got.prompt_logprobs] == [e and e.sampled for e in want.prompt_logprobs]


def test_a_draft_model_with_another_tokenizer_is_refused_at_load(tiny_model_paths, tmp_path):
    other = tmp_path / "other-tokenizer"
    shutil.copytree(tiny_model_paths["llama"], other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[1000:1002]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # the same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="tokenizer other than the target's"):
        LLM(str(tiny_model_paths["llama"]), speculative_config={"model": str(other)}, dtype="float32")


# -- exactness under sampling -------------------------------------------------------------------
class PoorProposer(Proposer):
    """A deliberately poor proposer: after token t it drafts the follower of t seen least often
    without speculation (accepted now and then, rejected mostly)."""

    name = "poor"

    def __init__(self, follower: dict[int, int]) -> None:
        self.follower = follower

    def propose(self, requests, limits):
        drafts = []
        for r, k in zip(requests, limits):
            chain = [r.token_ids[-1]]
            for _ in range(k):
                chain.append(self.follower.get(chain[-1], chain[-1] + 1))
            drafts.append(chain[1:])
        return drafts


def least_followers(samples: list[tuple[int, ...]]) -> dict[int, int]:
    seen: dict[int, Counter] = {}
    for s in samples:
        for a, b in zip(s, s[1:]):
            seen.setdefault(a, Counter())[b] += 1
    return {a: min(c, key=c.get) for a, c in seen.items()}


def samples(folder: str, proposer: Proposer | None = None, count: int = 1000) -> list[tuple[int, ...]]:
    """The three output tokens of `count` unseeded samples of one prompt (top_k 3: 27 outcomes).
    The first comes from the prefill; with a proposer, the second is a verified draft (accepted,
    or the token sampled in its place) and the third the token after it."""
    llm = LLM(folder, max_num_seqs=64, speculative_config={"method": "ngram", "adaptive": False,
                                                           "num_speculative_tokens": 2} if proposer else None, dtype="float32")
    if proposer is not None:
        llm.engine.speculator.proposer = proposer
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    outs = llm.generate([[11, 12, 13]] * count, params)
    if proposer is not None:
        proposer.stats = llm.engine.stats()
    return [tuple(o.outputs[0].token_ids) for o in outs]


def chi_square(a: list, b: list) -> tuple[float, int]:
    """Two-sample chi-square statistic over the outcomes seen (rare ones pooled) and its dof."""
    cats = sorted(set(a) | set(b))
    ca = torch.tensor([a.count(c) for c in cats], dtype=torch.float64)
    cb = torch.tensor([b.count(c) for c in cats], dtype=torch.float64)
    rare = (ca + cb) < 10
    if rare.any():
        ca = torch.cat([ca[~rare], ca[rare].sum(0, keepdim=True)])
        cb = torch.cat([cb[~rare], cb[rare].sum(0, keepdim=True)])
    total = ca + cb
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    stat = float((((ca - ea) ** 2) / ea + ((cb - eb) ** 2) / eb).sum())
    return stat, len(total) - 1


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square quantile at p = 0.999 (z = 3.09), by Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


@pytest.fixture(scope="module")
def unspeculated(tiny_model_paths):
    return samples(str(tiny_model_paths["llama"]))


def test_sampling_with_rejected_drafts_keeps_the_target_s_distribution(tiny_model_paths, unspeculated):
    proposer = PoorProposer(least_followers(unspeculated))
    stat, dof = chi_square(unspeculated, samples(str(tiny_model_paths["llama"]), proposer))
    assert proposer.stats["spec_num_draft_tokens"] == 1000  # every sample's second token was a draft
    assert 0 < proposer.stats["spec_num_accepted_tokens"] < 500  # mostly rejected
    assert dof >= 10  # a spread distribution, not one outcome
    assert stat < chi_square_critical(dof), (stat, dof)


def test_plain_acceptance_of_the_same_drafts_fails_the_same_test(tiny_model_paths, unspeculated, monkeypatch):
    """The test above has teeth: accepting drafts without the rejection step is caught."""
    def accept_all(logits, params, generators, drafts):
        tokens = sampler._choose(logits.clone(), params, generators)
        for i, draft in enumerate(drafts):
            if draft is not None:
                tokens[i] = draft  # row i "sampled" the draft that row i + 1 follows: accepted
        return tokens

    monkeypatch.setattr(sampler, "_choose_verifying", accept_all)
    proposer = PoorProposer(least_followers(unspeculated))
    stat, dof = chi_square(unspeculated, samples(str(tiny_model_paths["llama"]), proposer))
    assert stat > chi_square_critical(dof), (stat, dof)


# -- the draft's KV in a hand-off ---------------------------------------------------------------
def test_a_draft_s_prompt_kv_crosses_with_the_target_s_even_of_another_shape(tiny_model_paths):
    """A prefill engine computes the draft's prompt KV beside the target's; the payload carries
    both (the draft's reshaped as extra layers: here 2 KV heads of 32 beside 2 of 16), and the
    decode engine lands the draft's KV in its draft cache under the same block ids. Its layout
    names the draft, so a pool without it, or with another, refuses the payload."""
    target, draft = str(tiny_model_paths["llama"]), str(tiny_model_paths["mistral"])
    spec = {"model": draft, "num_speculative_tokens": 3, "adaptive": False}
    prefill, decode = LLM(target, speculative_config=spec, dtype="float32").engine, LLM(target, speculative_config=spec, dtype="float32").engine
    plain = LLM(target, dtype="float32").engine
    assert prefill.kv_layout() == decode.kv_layout() != plain.kv_layout()
    assert "+draft:mistral@" in decode.kv_layout().model

    prompt = list(range(300, 341))  # 41 tokens: 3 blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prefill.add_request("r", prompt, params, prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    handed = prefill.take_prefilled("r")
    payload = prefill.export_kv("r")
    assert payload.shape[0] == prefill.kv_layout().num_layers > plain.kv_layout().num_layers
    blocks = decode.admit_remote("r", prompt, params)
    decode.import_kv("r", payload)
    sent, landed = prefill.speculator.proposer.runner.kv_cache, decode.speculator.proposer.runner.kv_cache
    torch.testing.assert_close(landed[:, :, blocks], sent[:, :, handed.block_ids], rtol=0, atol=0)
    assert sent[:, :, handed.block_ids].abs().sum() > 0
    decode.finish_remote("r", ok=True, first_token=handed.first_token)
    finals = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            finals[out.request_id] = out.outputs[0].token_ids
    assert finals["r"] == LLM(target, dtype="float32").generate([prompt], params)[0].outputs[0].token_ids
    assert decode.stats()["spec_num_draft_tokens"] > 0
