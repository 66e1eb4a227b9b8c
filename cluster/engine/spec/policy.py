"""How many tokens to draft for each request this step (`adaptive`), from what drafts have
been worth and what positions cost.

Per request, an acceptance estimate `a` (each draft position accepted with probability a, given
the ones before it were): decayed counts of accepted and rejected positions, starting from the
engine-wide estimate. The j-th draft of a request yields a token only if drafts 1..j are all
accepted, so it is worth a^j tokens; k drafts are worth (1 - a^(k+1)) / (1 - a) - 1.

Per step, the engine's fitted step cost (engine/step_cost.py): time = fixed + per_token x tokens.
Estimates are floored at MIN_RATE, so an unlucky start does not stop a request speculating
for good where drafts are cheap.

A step that computes B tokens (the scheduler's plan) yields T expected tokens in C seconds; one
more draft of worth g costs per_token (plus, for a draft model, what drafting a token took, as
measured) and raises the step's rate T / C only when g / cost > T / C. Drafts are added best first (a heap over each request's next draft, whose
worth only falls with depth) while that holds: at one stream a step is bound by streaming the
weights, a draft position costs a sliver of it, and requests speculate deeply; at many streams
each position costs a full matmul row and drafts stop paying, so they stop by themselves.
Until the step cost is known (no fit yet), each request gets its full limit.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

DECAY = 0.9  # per observed step of a request's own acceptance history
# the estimate never goes below this: a request whose drafts were rejected early on keeps probing
# with one draft where a position costs next to nothing (one stream: ~1/25 of a step), so a reply
# that turns to copying is noticed; under load a draft must be worth far more than this to be tried
MIN_RATE = 0.1
PRIOR_WEIGHT = 2.0  # how many positions the engine-wide estimate counts for in a new request's
ENGINE_DECAY = 0.995


@dataclass
class Acceptance:
    """Decayed counts of draft positions accepted and tried."""

    accepted: float
    tried: float

    @property
    def rate(self) -> float:
        return self.accepted / self.tried if self.tried > 0 else 0.0

    def observe(self, drafted: int, accepted: int, decay: float) -> None:
        # positions past the first rejection were never tested: a truncated geometric
        self.accepted = self.accepted * decay + accepted
        self.tried = self.tried * decay + accepted + (1 if accepted < drafted else 0)


class DraftPolicy:
    def __init__(self, max_tokens: int, adaptive: bool) -> None:
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.engine = Acceptance(0.5, 1.0)  # before any request speculated: even odds
        self.requests: dict[str, Acceptance] = {}

    def rate(self, request_id: str) -> float:
        a = self.requests.get(request_id)
        return max(self.engine.rate if a is None else a.rate, MIN_RATE)

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        a = self.requests.get(request_id)
        if a is None:
            prior = self.engine.rate
            a = self.requests[request_id] = Acceptance(prior * PRIOR_WEIGHT, PRIOR_WEIGHT)
        a.observe(drafted, accepted, DECAY)
        self.engine.observe(drafted, accepted, ENGINE_DECAY)

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def choose(self, request_ids: Sequence[str], limits: Sequence[int], step_tokens: int,
               fixed_s: float | None, per_token_s: float | None, drafting_s: float = 0.0) -> list[int]:
        """Draft lengths (each <= its limit and max_tokens) for the requests of a step that
        already computes `step_tokens` tokens and yields one token per request. `drafting_s`:
        what proposing one draft token costs (a draft model's pass; ~0 for pattern lookups)."""
        limits = [min(k, self.max_tokens) for k in limits]
        if not self.adaptive or per_token_s is None or fixed_s is None:
            return limits
        rates = [self.rate(r) for r in request_ids]
        cost = per_token_s + max(drafting_s, 0.0)  # one more draft: its position, and drafting it
        tokens = float(len(request_ids))  # expected tokens of the step
        seconds = max(fixed_s, 0.0) + per_token_s * step_tokens
        chosen = [0] * len(limits)
        heap = [(-a, i) for i, (a, k) in enumerate(zip(rates, limits)) if k > 0 and a > 0]
        heapq.heapify(heap)
        while heap:
            neg_worth, i = heapq.heappop(heap)
            worth = -neg_worth
            if worth * seconds <= cost * tokens:  # g / cost <= T / C: no gain
                break
            chosen[i] += 1
            tokens += worth
            seconds += cost
            if chosen[i] < limits[i]:
                heapq.heappush(heap, (-worth * rates[i], i))
        return chosen
