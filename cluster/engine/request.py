"""A request's state inside one engine (plain values, no torch)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cluster.engine.outputs import TokenLogprobs
from cluster.sampling_params import SamplingParams

if TYPE_CHECKING:
    from cluster.engine.structured.constraint import Constraint


class RequestStatus(enum.IntEnum):
    """Lifecycle. Every state after PREEMPTED is finished, so `is_finished` is one comparison."""

    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1  # blocks allocated, prompt KV arriving from a prefill worker
    RUNNING = 2
    PREEMPTED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7
    FINISHED_PREFILLED = 8  # prefill-only: first token sampled, blocks held for hand-off

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Request:
    """One sequence. `token_ids` is prompt + output; the first `num_computed_tokens` of
    them have KV in the blocks of `block_ids` (block i holds tokens [i*bs, (i+1)*bs)).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    eos_token_ids: frozenset[int] = frozenset()
    prefill_only: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    ready_at: float = -1.0  # when it could first be scheduled here: arrival, or its remote KV landing
    queue_s: float | None = None  # from ready_at to the first step that scheduled it
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    constraint: Constraint | None = None  # structured output: the sampler keeps the reply in its grammar
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.. so far
    num_draft_tokens: int = 0  # speculative decoding: tokens drafted for this request here
    num_accepted_tokens: int = 0  # ... and of them accepted

    def __post_init__(self) -> None:
        if self.ready_at < 0:
            self.ready_at = self.arrival_time
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and not all of them are known yet (their positions must be
        computed here, so no prefix-cache hits)."""
        return (self.params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_token_stop(self) -> RequestStatus | None:
        """Token-level stop conditions after a token was appended (stop strings are the
        detokenizer's job). Returns the finished status, or None to keep going."""
        last = self.token_ids[-1]
        n_out = self.num_output_tokens
        if n_out > self.params.min_tokens:
            if not self.params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if last in self.params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.params.max_tokens is not None and n_out >= self.params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
