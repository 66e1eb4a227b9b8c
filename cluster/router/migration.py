"""Request migration: when the decode replica streaming a request dies, the request goes on
on another decode replica from where the client is, with nothing lost or repeated.

    stream(R) on a decode replica ──▶ deltas forwarded (their token ids remembered)
        replica lost mid-stream (and migrations left)
            ──▶ stream(R') on another replica: prompt = R's prompt + the tokens already sent,
                max_tokens / min_tokens reduced by what was sent, JSON mode told
                that those tokens are output (prior_output_tokens)
        no migrations left ──▶ the loss is raised (the OpenAI layer turns it into an error
                               chunk after the first byte, an HTTP error before it)

What carries over exactly: the token sequence, so greedy requests continue exactly as they
would have, and JSON mode's place in the object (prompt scores went out with the first delta,
so a moved request does not score its new prompt). What does not: a seeded sampler's random
state (the continuation is a valid sample, not the same one), penalties' counts of the tokens
sent before the move (they become prompt), and a stop string that straddles the move. Plain
object: no Ray here; `is_lost` says which exceptions mean "the replica is gone".
"""

from __future__ import annotations

import dataclasses
from typing import Any, AsyncIterator, Callable

from cluster.engine.outputs import TokenDelta
from cluster.sampling_params import SamplingParams

StartFn = Callable[[str, list[int], SamplingParams], Any]  # → an async iterator of list[TokenDelta]


async def migrating(start: StartFn, request_id: str, prompt_ids: list[int], params: SamplingParams, *,
                    max_migrations: int, is_lost: Callable[[BaseException], bool],
                    on_migrate: Callable[[], None] = lambda: None) -> AsyncIterator[list[TokenDelta]]:
    sent: list[int] = []
    for attempt in range(max_migrations + 1):
        rid, call_params = request_id, params
        if attempt:
            rid = f"{request_id}-m{attempt}"
            call_params = _remaining(params, len(sent))
            if call_params is None:  # every token was already sent: only the finish was lost
                yield [TokenDelta("", [], finish_reason="length")]
                return
        stream = start(rid, prompt_ids + sent, call_params)
        done = False
        try:
            async for deltas in stream:
                for d in deltas:
                    sent.extend(d.token_ids)
                yield deltas
            done = True
            return
        except Exception as exc:
            if not is_lost(exc) or attempt == max_migrations:
                raise
            on_migrate()
        finally:
            if not done:
                await stop_stream(stream)  # the client went away, or the replica did: abort R there


def _remaining(params: SamplingParams, sent: int) -> SamplingParams | None:
    if params.max_tokens is not None and params.max_tokens - sent < 1:
        return None
    return dataclasses.replace(
        params,
        max_tokens=None if params.max_tokens is None else params.max_tokens - sent,
        min_tokens=max(0, params.min_tokens - sent),
        prior_output_tokens=sent,
        prompt_logprobs=None if sent else params.prompt_logprobs,  # the first delta carried them
    )


async def stop_stream(stream: Any) -> None:
    """Close a call's stream: a Serve response generator is cancelled (R is aborted there)."""
    cancel = getattr(stream, "cancel", None)  # a Serve response generator
    if cancel is not None:
        cancel()
    elif hasattr(stream, "aclose"):  # a plain async generator
        await stream.aclose()
