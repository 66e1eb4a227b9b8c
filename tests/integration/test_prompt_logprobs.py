"""Prompt logprobs (`SamplingParams.prompt_logprobs`, what /v1/completions' `echo` returns):
the model's own log-probabilities of each prompt token, checked against HF transformers (so in
float32, HF's dtype here: `auto` is bf16 on a CPU where bf16 beats fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams
from tests.integration.test_engine import mixed_prompts, token_ids

K = 3


@pytest.fixture(scope="module")
def hf_prompt_logprobs(tiny_model_paths):
    """prompt ids → HF's log_softmax at every position [P, V] (row p scores token p + 1)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_paths["llama"], dtype=torch.float32)

    def score(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return score


def assert_prompt_logprobs_match(out, reference: torch.Tensor, k: int = K) -> None:
    ids, got = out.prompt_token_ids, out.prompt_logprobs
    assert got is not None and len(got) == len(ids) and got[0] is None
    for p, entry in enumerate(got[1:], start=1):
        assert entry.sampled.token_id == ids[p]
        assert entry.sampled.logprob == pytest.approx(reference[p - 1, ids[p]].item(), abs=1e-4)
        lp = reference[p - 1, ids[p]]  # its rank: 1 + the tokens likelier (within the tolerance)
        assert 1 + (reference[p - 1] > lp + 1e-4).sum() <= entry.rank <= 1 + (reference[p - 1] > lp - 1e-4).sum()
        top = reference[p - 1].topk(k)
        assert [t.token_id for t in entry.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([t.logprob for t in entry.top]), top.values, atol=1e-4, rtol=0)


@pytest.mark.parametrize("engine_args,proves", [
    ({}, None),
    ({"max_num_batched_tokens": 8}, "chunked"),  # the 90-token prompt is scored over 12 steps
    ({"num_blocks": 16, "block_size": 8, "max_num_batched_tokens": 8}, "preempted"),  # mid-prompt: scored once
])
def test_prompt_logprobs_equal_hf_in_a_mixed_batch(tiny_model_paths, hf_prompt_logprobs, engine_args, proves):
    prompts = mixed_prompts()  # 3 … 90 tokens, one of a single token
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    scored = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=K)
    llm = LLM(str(tiny_model_paths["llama"]), **engine_args, dtype="float32")
    outs = llm.generate(prompts, [scored if i % 2 == 0 else plain for i in range(len(prompts))])
    for i, out in enumerate(outs):
        if i % 2:
            assert out.prompt_logprobs is None
        else:
            assert_prompt_logprobs_match(out, hf_prompt_logprobs(prompts[i]))
    # scoring the prompt changes nothing about what is generated
    alone = LLM(str(tiny_model_paths["llama"]), enable_prefix_caching=False, dtype="float32").generate(prompts, plain)
    assert token_ids(outs) == token_ids(alone)
    stats = llm.engine.stats()
    if proves == "preempted":
        assert stats["num_preemptions"] > 0
    assert stats["blocks_in_use"] == 0


def test_a_cached_prompt_is_scored_in_full_and_the_score_crosses_the_hand_off(tiny_model_paths, hf_prompt_logprobs):
    folder = str(tiny_model_paths["llama"])
    prompt = mixed_prompts()[1]  # 90 tokens: five full 16-token blocks
    reference = hf_prompt_logprobs(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=K)

    warm = LLM(folder, dtype="float32")
    warm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))  # the prompt's blocks are cached now
    again = warm.generate([prompt], params)[0]
    assert again.num_cached_tokens == 0  # a hit would leave the cached positions unscored
    assert_prompt_logprobs_match(again, reference)

    # disaggregated: the prefill side scores the prompt, the decode side hands the score on
    prefill, decode = LLM(folder, dtype="float32").engine, LLM(folder, dtype="float32").engine
    prefill.add_request("r", prompt, params, prefill_only=True)
    while prefill.has_unfinished_requests():
        prefill.step()
    result = prefill.take_prefilled("r")
    packed = prefill.export_kv("r")
    prefill.release("r")
    for ok in (True, False):  # the KV landed / it did not and decode recomputes the prompt
        rid = f"r-{ok}"
        assert decode.admit_remote(rid, prompt, params) is not None
        if ok:
            decode.import_kv(rid, packed)
        first = decode.finish_remote(rid, ok=ok, first_token=result.first_token,
                                     first_logprobs=result.first_logprobs, prompt_logprobs=result.prompt_logprobs)
        assert_prompt_logprobs_match(first, reference)
        while decode.has_unfinished_requests():
            for out in decode.step():
                last = out
        assert last.outputs[0].token_ids == again.outputs[0].token_ids
    assert decode.stats()["blocks_in_use"] == 0 and prefill.stats()["blocks_in_use"] == 0
