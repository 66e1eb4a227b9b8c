"""The offline `LLM` API's contract with its caller: what it takes (text, token ids, vLLM's
prompt dicts; bad input refused by name, before the engine holds anything) and what it gives (n
samples, stop strings, logprobs), on a tiny random checkpoint."""

from __future__ import annotations

import json

import pytest

from cluster import LLM, SamplingParams
from cluster.models.architecture import UnsupportedModelError


def test_n_samples_stop_strings_and_logprobs_reach_the_outputs(tiny_model_paths):
    llm = LLM(str(tiny_model_paths["llama"]))
    greedy = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=24,
                                                                  ignore_eos=True))[0].outputs[0]
    stop = greedy.text[len(greedy.text) // 2: len(greedy.text) // 2 + 3]
    assert stop.strip(), greedy.text
    cut = llm.generate(["The quick brown fox"], SamplingParams(temperature=0.0, max_tokens=24,
                                                               ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == greedy.text[: greedy.text.index(stop)]

    many = llm.generate(["The quick brown fox"], SamplingParams(n=3, temperature=1.0, seed=5,
                                                                max_tokens=8, logprobs=3))[0]
    assert [c.index for c in many.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in many.outputs}) > 1
    for c in many.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for step, token in zip(c.logprobs, c.token_ids):
            assert step.sampled.token_id == token and len(step.top) == 3
            assert step.top[0].logprob >= step.sampled.logprob


def test_unsupported_architecture_fails_at_load_with_the_supported_list(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_bad_requests_are_refused_with_clear_errors(tiny_model_paths):
    llm = LLM(str(tiny_model_paths["llama"]), max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5] * 64], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[49152]], SamplingParams())
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_seq'"):
        LLM(str(tiny_model_paths["llama"]), max_num_seq=4)
    with pytest.raises(ValueError, match="'prompt_token_ids'.*got keys \\['multi_modal_data', 'prompt'\\]"):
        llm.generate({"prompt": "hi", "multi_modal_data": {}}, SamplingParams())
    with pytest.raises(TypeError, match="token ids"):
        llm.generate([["a", "b"]], SamplingParams())
    assert llm.engine.stats()["blocks_in_use"] == 0


def test_vllms_prompt_dicts_give_what_text_and_token_ids_give(tiny_model_paths):
    """`{"prompt": text}` and `{"prompt_token_ids": ids}`, vLLM's TextPrompt and TokensPrompt."""
    llm = LLM(str(tiny_model_paths["llama"]))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = llm.get_tokenizer().encode("The capital of France is")
    want = llm.generate(["The capital of France is", ids], greedy)
    got = llm.generate([{"prompt": "The capital of France is"}, {"prompt_token_ids": ids}], greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[0].prompt == "The capital of France is" and got[1].prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids == want[1].outputs[0].token_ids
