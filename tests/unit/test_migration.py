"""Request migration as a plain async function: what the next replica is asked for when the
one streaming a request is lost. The real thing (a decode replica SIGKILLed mid-stream):
tests/cluster/test_faults.py."""

from __future__ import annotations

import asyncio

from cluster.engine.outputs import TokenDelta
from cluster.router.migration import migrating
from cluster.sampling_params import SamplingParams
from cluster.structured_output import StructuredOutput


class Lost(Exception):
    pass


def test_the_next_replica_continues_after_the_tokens_sent_with_json_mode_told_so():
    """...and does not score its prompt again: the prompt's scores left with the first delta."""
    calls = []

    async def start(rid, prompt_ids, params):
        calls.append((rid, prompt_ids, params))
        if len(calls) == 1:
            yield [TokenDelta("{", [10])]
            yield [TokenDelta('"a', [11, 12])]
            raise Lost
        yield [TokenDelta('": 1}', [13], finish_reason="stop")]

    async def go():
        params = SamplingParams(max_tokens=8, min_tokens=4, structured=StructuredOutput("json_object"), prompt_logprobs=1)
        return [d async for ds in migrating(start, "r", [1, 2], params, max_migrations=1,
                                            is_lost=lambda e: isinstance(e, Lost)) for d in ds]

    deltas = asyncio.run(go())
    assert [t for d in deltas for t in d.token_ids] == [10, 11, 12, 13]
    rid, prompt, params = calls[1]
    assert rid == "r-m1" and prompt == [1, 2, 10, 11, 12]
    assert (params.max_tokens, params.min_tokens, params.prior_output_tokens) == (5, 1, 3)
    assert params.structured == StructuredOutput("json_object") and params.prompt_logprobs is None and calls[0][2].prompt_logprobs == 1
