"""The padded static decode that CUDA graphs replay, run eagerly on CPU.

A GPU captures `DecodeGraphs._forward` and replays it (tests/integration/test_engine_cuda.py);
here the same buffers, row layout and pad rows run without capture, against the engine's own
decode path, so CI checks what a graph would be fed.
"""

from __future__ import annotations

import pytest
from test_engine import assert_same_greedy_replies, mixed_prompts

from cluster import LLM, SamplingParams
from cluster.engine.cuda_graphs import DecodeGraphs, capture_sizes


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 32},  # prompts join one by one: batches of 1 .. 8
    {"num_blocks": 16, "block_size": 8},  # preemption and recompute
])
def test_padded_static_decode_gives_the_eager_tokens(tiny_model_paths, engine_args):
    folder = str(tiny_model_paths["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    expected = LLM(folder, **engine_args).generate(mixed_prompts(), params)

    llm = LLM(folder, **engine_args)
    runner = llm.engine.runner
    # at most 6 rows: the 8 prompts' decode batches of 3, 5 ... are padded, those of 7-8 run eagerly
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.block_size,
                                 llm.engine.max_model_len, max_batch=6, capture=False)
    got = llm.generate(mixed_prompts(), params)

    assert runner.graphs.steps > 0
    assert_same_greedy_replies(got, expected, tol=1e-4)
    assert llm.engine.stats()["blocks_in_use"] == 0
