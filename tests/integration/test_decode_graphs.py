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


def test_verify_steps_through_the_padded_static_decode_give_the_unspeculated_tokens(tiny_model_paths):
    """Speculating, a verify chunk's 1 + k positions are fed as decode rows of the same buffer
    (each attending up to itself); the tokens are those of plain eager decoding."""
    folder = str(tiny_model_paths["llama"])
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    expected = LLM(folder, max_num_batched_tokens=32).generate(mixed_prompts(), params)

    spec = {"model": folder, "adaptive": False, "num_speculative_tokens": 3}  # itself: drafts accepted
    llm = LLM(folder, max_num_batched_tokens=32, speculative_config=spec)
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.block_size,
                                 llm.engine.max_model_len, max_batch=32, capture=False)
    verify_rows = []  # per replayed step: rows that continue the row before's sequence (drafts)
    run = runner.graphs.run
    runner.graphs.run = lambda rows: verify_rows.append(
        sum(b[1] == a[1] + 1 and b[4][:len(a[4])] == a[4] for a, b in zip(rows, rows[1:]))) or run(rows)
    got = llm.generate(mixed_prompts(), params)

    assert sum(verify_rows) > 0 and llm.engine.speculator.stats()["spec_num_accepted_tokens"] > 0
    assert_same_greedy_replies(got, expected, tol=1e-4)
    assert llm.engine.stats()["blocks_in_use"] == 0
