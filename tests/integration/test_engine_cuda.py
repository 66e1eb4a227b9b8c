"""The engine on a CUDA device (Triton kernels; bf16 unless told) against the same engine on CPU.

These need a GPU, so CI's machines report them as skipped; there the Triton code is checked
through the interpreter by tests/unit/test_kernels.py. Run them where torch sees a GPU:
`python -m pytest tests/integration/test_engine_cuda.py tests/unit/test_kernels.py`.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_engine import assert_same_greedy_replies, mixed_prompts, token_ids

from cluster import LLM, SamplingParams, StructuredOutput

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHATS = [[{"role": "user", "content": q}] for q in
         ("What is the capital of France?", "Name three primary colors.",
          "Explain what a CPU does in one sentence.")]


def cuda_llm(model: str | None = None, **engine_args) -> LLM:
    """fp32 unless told, and a KV cache sized for a test rather than 90% of the GPU."""
    return LLM(model, device="cuda", **{"dtype": "float32", "num_blocks": 2048, **engine_args})


# ngram drafts on a random model's own repeats; fixed lengths, so every step that can verifies
NGRAM = {"method": "ngram", "adaptive": False, "prompt_lookup_min": 1, "num_speculative_tokens": 3}


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("engine_args", [
    {}, {"max_num_batched_tokens": 8},  # decodes beside prefill chunks over a cached prefix
    {"num_blocks": 16, "block_size": 8},  # preemption and recompute
])
@pytest.mark.parametrize("spec", [None, NGRAM], ids=["plain", "ngram"])
def test_cuda_fp32_gives_the_cpu_tokens_on_a_mixed_batch(tiny_model_paths, kind, engine_args, spec):
    """CUDA (graphs, Triton) against CPU, both with or without speculation; the CPU reference is
    always unspeculated, so a verify step's tokens are checked against plain decoding too."""
    folder = str(tiny_model_paths[kind])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    expected = LLM(folder, device="cpu", **engine_args).generate(mixed_prompts(), params)
    llm = cuda_llm(folder, **engine_args, **({"speculative_config": spec} if spec else {}))
    got = llm.generate(mixed_prompts(), params)
    assert_same_greedy_replies(got, expected, tol=1e-3)
    assert llm.engine.stats()["blocks_in_use"] == 0
    assert llm.engine.runner.graphs.steps > 0  # the decode-only steps were graph replays


def test_graph_replays_give_the_eager_steps_tokens(tiny_model_paths):
    """CUDA graphs (the default) against `enforce_eager`, both on CUDA, prompts joining one by
    one so the decode batch takes sizes between the captured ones (padded) and mixed steps run
    eagerly in between; then a batch as large as the largest graph."""
    folder = str(tiny_model_paths["qwen2"])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    args = {"max_num_batched_tokens": 32, "max_num_seqs": 12}
    eager = cuda_llm(folder, enforce_eager=True, **args)
    assert eager.engine.runner.graphs is None
    graphs = cuda_llm(folder, **args)
    assert sorted(graphs.engine.runner.graphs.graphs) == [1, 2, 4, 8, 12]
    for prompts in (mixed_prompts(), mixed_prompts() + mixed_prompts(4)):
        assert_same_greedy_replies(graphs.generate(prompts, params), eager.generate(prompts, params), tol=1e-4)
    assert graphs.engine.runner.graphs.steps > 0
    assert graphs.engine.stats()["blocks_in_use"] == 0


def test_verify_steps_are_graph_replays(tiny_model_paths):
    """With speculation on, a step of decodes and their drafts replays a graph (1 + k rows a
    request) and gives the tokens of eager unspeculated decoding on the same device."""
    folder = str(tiny_model_paths["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=1)
    args = {"max_num_batched_tokens": 64, "max_num_seqs": 8}
    eager = cuda_llm(folder, enforce_eager=True, **args)
    self_draft = {"model": folder, "adaptive": False, "num_speculative_tokens": 3}  # drafts accepted
    spec = cuda_llm(folder, speculative_config=self_draft, **args)
    graphs = spec.engine.runner.graphs
    assert graphs.max_batch == 8 * (1 + 3)  # a full batch with its drafts fits the graphs
    sizes = []
    run = graphs.run
    graphs.run = lambda rows: sizes.append(len(rows)) or run(rows)
    assert_same_greedy_replies(spec.generate(mixed_prompts(), params), eager.generate(mixed_prompts(), params),
                               tol=1e-4)
    accepted = spec.engine.speculator.stats()["spec_num_accepted_tokens"]
    assert accepted > 0 and max(sizes) > len(mixed_prompts())  # verify rows went through the graphs
    assert spec.engine.stats()["blocks_in_use"] == 0


@pytest.mark.parametrize("prefill_device,decode_device", [("cuda", "cpu"), ("cpu", "cuda")])
def test_kv_packed_on_one_device_decodes_on_the_other(tiny_model_paths, prefill_device, decode_device):
    """The hand-off a disaggregated pair makes, across devices: pack_kv on one side, unpack_kv
    on the other, payload through host memory; the tokens are the colocated CPU ones."""
    folder = str(tiny_model_paths["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = mixed_prompts()[:4]
    expected = token_ids(LLM(folder, device="cpu").generate(prompts, params))
    make = {"cpu": lambda: LLM(folder, device="cpu").engine, "cuda": lambda: cuda_llm(folder).engine}
    prefill, decode = make[prefill_device](), make[decode_device]()

    for i, prompt in enumerate(prompts):
        prefill.add_request(f"p{i}", prompt, params, prefill_only=True)
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            result, packed = prefill.take_prefilled(out.request_id), prefill.export_kv(out.request_id)
            prefill.release(out.request_id)
            assert packed.device.type == "cpu"  # what a connector sends
            assert decode.admit_remote(out.request_id, result.prompt_token_ids, params) is not None
            decode.import_kv(out.request_id, packed)
            decode.finish_remote(out.request_id, ok=True, first_token=result.first_token)
    finals = {}
    while decode.has_unfinished_requests():
        for out in decode.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    assert [finals[f"p{i}"] for i in range(len(prompts))] == expected
    assert prefill.stats()["blocks_in_use"] == decode.stats()["blocks_in_use"] == 0


def first_logprobs(llm: LLM, prompts: list[list[int]]) -> list[dict[int, float]]:
    """Each prompt's first sampled position: token id → logprob for its 20 likeliest tokens."""
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=20))
    return [{t.token_id: t.logprob for t in o.outputs[0].logprobs[0].top} for o in outs]


@pytest.mark.slow
def test_default_model_on_cuda(default_model_path):
    """fp32 on CUDA gives CPU fp32's greedy tokens (Paris among them); bf16, the CUDA default,
    stays close to fp32 and keeps JSON mode's promise."""
    params = SamplingParams(temperature=0.0, max_tokens=32)
    cpu = LLM(device="cpu")
    expected = cpu.chat(CHATS, params)
    assert token_ids(cuda_llm().chat(CHATS, params)) == token_ids(expected)
    assert "Paris" in expected[0].outputs[0].text

    # bf16 moves this model's logprobs by up to ~0.2 (HF transformers' bf16 by up to ~0.11),
    # more than the 0.08 by which "The" beats "L" as CHATS[0]'s first token: bf16 is judged by
    # its error on the likeliest tokens, where a real precision bug costs whole units
    prompts = [cpu.engine.tokenizer.encode_chat(c) for c in CHATS]
    bf16 = LLM(device="cuda", num_blocks=2048)
    assert bf16.engine.runner.dtype == torch.bfloat16
    for ref, ours in zip(first_logprobs(cpu, prompts), first_logprobs(bf16, prompts)):
        top = sorted(ref, key=ref.get, reverse=True)[:5]
        assert max(abs(ours.get(t, -99.0) - ref[t]) for t in top) < 0.3, (ref, ours)

    cat = [{"role": "user", "content": "Give me a JSON object describing a cat with keys name, age and color."}]
    out = bf16.chat(cat, SamplingParams(temperature=0.0, max_tokens=80, structured=StructuredOutput("json_object")))[0].outputs[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text
