"""Conditional disaggregation (`max_local_prefill_tokens`) on real engines in one process: a prompt
with few tokens its decode replica's prefix cache does not hold is prefilled on that replica;
any other goes through the prefill pool; both give the tokens colocated serving gives, and every
block is back when they are done."""

from __future__ import annotations

import pytest

from cluster.sampling_params import SamplingParams
from openai_helpers import run, serving_stack

LIMIT = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def pools(tiny_model_paths):
    with serving_stack(str(tiny_model_paths["llama"]), {"num_blocks": 64, "max_num_seqs": 8},
                       app={"max_local_prefill_tokens": LIMIT}) as s:
        yield s


def generate(pools, rid: str, prompt: list[int], disaggregated: bool = True,
             params: SamplingParams = GREEDY) -> tuple[list[int], dict]:
    """(the tokens, the trace) of one request on the disaggregated or the colocated decode server."""
    from cluster.prefill.server import LocalPrefillClient

    async def go():
        tokens, trace = [], {}
        server = pools["decode"] if disaggregated else pools["colocated_server"]
        client = LocalPrefillClient(pools["prefill"]) if disaggregated else None
        async for deltas in server.generate(rid, prompt, params, client):
            for d in deltas:
                tokens += d.token_ids
                trace = d.trace or trace
        return tokens, trace

    return run(go())


def test_only_prompts_with_few_uncached_tokens_skip_the_prefill_pool(pools):
    long_prompt = [(7 * i) % 500 + 3 for i in range(60)]
    cases = [("short", [5, 17, 29, 41, 53, 65, 77, 89, 101, 113], "short: prefilled here (10 uncached tokens)"),
             ("long", long_prompt, "landed"),
             # the next turn: the first 48 tokens are cached on decode now, 22 are left
             ("next-turn", long_prompt + [201, 202, 203, 204, 205, 206, 207, 208, 209, 210],
              "short: prefilled here (22 uncached tokens)")]
    sent = pools["prefill"].worker.counters
    for name, prompt, kv in cases:
        before = sent["acked"]
        tokens, trace = generate(pools, name, prompt)
        assert trace["kv"] == kv, name
        assert sent["acked"] - before == (kv == "landed"), name  # the prefill pool saw it, or not
        assert tokens == generate(pools, f"{name}-colocated", prompt, disaggregated=False)[0], name
    # the same next turn, scored (prompt_logprobs): computed whole, so over the limit
    scored = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)
    _, trace = generate(pools, "scored", cases[2][1], params=scored)
    assert trace["kv"] == "landed"
    stats = run(pools["decode"].stats())
    assert stats["prefilled_locally_short"] == 2 and stats["blocks_in_use"] == 0
    assert run(pools["prefill"].stats())["blocks_in_use"] == 0


def test_the_threshold_is_validated_with_the_app_config():
    from cluster.config import AppConfig

    for bad in (-1, True, 1.5, "8"):
        with pytest.raises(ValueError, match="max_local_prefill_tokens must be an integer >= 0"):
            AppConfig.from_args({"max_local_prefill_tokens": bad})
