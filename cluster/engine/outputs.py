"""What the engine hands back per step and per request (plain values)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Logprob(NamedTuple):
    token_id: int
    logprob: float


class TokenLogprobs(NamedTuple):
    """The sampled (or prompt) token's logprob, the top-k alternatives (highest first), and
    the token's rank in the vocabulary (1 = the likeliest; ties share the better rank)."""

    sampled: Logprob
    top: list[Logprob]
    rank: int | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None (running)
    stop_reason: int | str | None = None  # the stop string or stop token id that matched
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""  # new since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0
    time: float = 0.0  # time.monotonic() when the engine produced it
    queue_s: float | None = None  # how long the request waited for its first step on this engine
    # when asked for (`SamplingParams.prompt_logprobs`): one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted for it on this engine so far
    num_accepted_tokens: int = 0  # ... of which accepted


@dataclass(frozen=True)
class PrefillResult:
    """A prefill-only request's hand-off: its first token and the blocks holding its prompt KV.

    The blocks stay owned by the prefill engine until `release(request_id)`.
    """

    request_id: str
    prompt_token_ids: list[int]
    first_token: int
    first_logprobs: TokenLogprobs | None
    block_ids: list[int]
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1.., when asked for
    num_cached_tokens: int = 0  # prompt tokens the prefill side's prefix cache served


class StreamStart(NamedTuple):
    """The first item of a request's own stream when its router multiplexes (decode/channels.py):
    which decode replica took it, and whether its deltas come over that router's channel."""

    replica: str
    multiplexed: bool


class ChannelClosed(RuntimeError):
    """A router's multiplexed channel closed while a request's tokens still went through it
    (either side raises it); the router takes it as a lost replica and migrates the request."""


@dataclass
class TokenDelta:
    """What a decode replica streams per request: the tokens since the previous delta.

    Several engine steps may be coalesced into one delta when the consumer is behind.
    """

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None  # one per token in token_ids, when asked for
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    trace: dict | None = None  # on a request's last delta: where and how long each part took
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on the delta with the first token

    @classmethod
    def merge(cls, outs: list[RequestOutput]) -> TokenDelta:
        """One delta out of consecutive outputs of the same request."""
        last = outs[-1]
        done = last.outputs[0]
        token_ids = [t for o in outs for t in o.outputs[0].delta_token_ids]
        logprobs = done.logprobs[len(done.logprobs) - len(token_ids):] if done.logprobs is not None else None
        first = bool(token_ids) and len(token_ids) == len(done.token_ids)  # the request's first delta
        return cls("".join(o.outputs[0].delta_text for o in outs), token_ids, logprobs,
                   done.finish_reason, done.stop_reason, len(last.prompt_token_ids), last.num_cached_tokens,
                   prompt_logprobs=last.prompt_logprobs if first else None)

    @classmethod
    def concat(cls, deltas: list[TokenDelta]) -> TokenDelta:
        """Consecutive deltas of one request as one: text, tokens and logprobs in order; the
        finish, stop reason and trace of the last; prompt scores and counts of the first."""
        if len(deltas) == 1:
            return deltas[0]
        first, last = deltas[0], deltas[-1]
        logprobs = None
        if any(d.logprobs is not None for d in deltas):
            logprobs = [e for d in deltas for e in d.logprobs or ()]
        return cls("".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids], logprobs,
                   last.finish_reason, last.stop_reason, first.num_prompt_tokens, first.num_cached_tokens,
                   last.trace, next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None))
