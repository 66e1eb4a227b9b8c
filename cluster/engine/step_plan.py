"""A step as a plain value: what the scheduler plans (`Scheduler.schedule`), the model runner
executes, and the scheduler then applies (`Scheduler.update`). No torch.

    StepPlan.chunks     every request in the step, with the span of its tokens it computes
    StepPlan.preempted  the ids of requests this step's planning put back to recompute
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.engine.request import Request


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens token_ids[start:start+num_tokens] of `request` run this step. A decoding request
    may carry draft tokens (speculative decoding): they follow its last token, at positions
    num_tokens .. num_tokens + len(drafts) - 1, and count in `num_tokens`; every position of the
    chunk is sampled, and the drafts are verified against those samples.

        token_ids  | ... t(n-1) |                 num_tokens = 1 + 3
        chunk      |   t(n-1)   | d0 | d1 | d2 |   sampled: 4 rows
    """

    request: Request
    start: int
    num_tokens: int
    draft_token_ids: tuple[int, ...] = ()

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)

    @property
    def samples(self) -> bool:
        """The chunk reaches the end of the known tokens, so its last position is sampled."""
        return self.start + self.num_tokens - len(self.draft_token_ids) == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        """The tokens this chunk computes, drafts included."""
        known = self.request.token_ids[self.start:self.start + self.num_tokens - len(self.draft_token_ids)]
        return known + list(self.draft_token_ids)


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks
