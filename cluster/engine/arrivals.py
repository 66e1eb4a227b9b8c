"""How big a chunk of a long prompt a prefill replica computes per step, from the prompts it has
seen arrive (`chunk_by_arrivals`; plain values, no torch).

`long_prefill_token_threshold` caps a prompt's chunk so that a short prompt arriving during a
long one waits for one small chunk, not a big one. That pays only while prompts arrive: alone on
a quiet replica, a long prompt in chunks of the cap pays a step's fixed part per extra chunk and
spares no one. With a fit of `fixed + per_token x tokens`, a chunk of n tokens takes t(n)
seconds; against chunks of the cap c it

- saves the prompt (n/c - 1) x fixed, and
- makes each prompt that arrives during it (rate x t(n) of them) wait (t(n) - t(c)) / 2 longer
  on average, and the prompts queued behind them as long again: x 1 / (1 - load) (the wait of a
  non-preemptive priority queue).

`chunk_size` takes the multiple of the cap (up to the budget) with the least expected sum: the
budget on a quiet replica, the cap under a steady stream of prompts, a size between them
between. Rate and load come from `ArrivalWindow`: the prompts that arrived over the last
WINDOW_S, a second, and their fitted compute time a second.
"""

from __future__ import annotations

import math
from collections import deque

WINDOW_S = 60.0  # the arrivals counted
PRIOR_S = 2.0  # added to the time they are counted over: a replica's first prompt reads as 0.5/s


class ArrivalWindow:
    """Prefill-only prompts that arrived over the last WINDOW_S: (time, prompt tokens) each."""

    def __init__(self) -> None:
        self.arrivals: deque[tuple[float, int]] = deque()
        self.tokens = 0  # theirs in all
        self.first: float | None = None

    def add(self, time: float, tokens: int, now: float) -> None:
        self.arrivals.append((time, tokens))
        self.tokens += tokens
        if self.first is None:
            self.first = time
        self._forget(now)  # on each arrival too: a replica that never chunks keeps a window's worth

    def seen(self, now: float, fixed: float, per_token: float) -> tuple[float, float]:
        """(rate, load): prompts a second and their compute time by the fit (a step each) a second,
        over the window, or since the first arrival plus PRIOR_S (one prompt on a new replica is
        not read as a quiet replica's)."""
        self._forget(now)
        if self.first is None:
            return 0.0, 0.0
        span = min(WINDOW_S, now - self.first) + PRIOR_S
        work = fixed * len(self.arrivals) + per_token * self.tokens
        return len(self.arrivals) / span, work / span

    def _forget(self, now: float) -> None:
        while self.arrivals and self.arrivals[0][0] < now - WINDOW_S:
            self.tokens -= self.arrivals.popleft()[1]


def chunk_size(rest: int, cap: int, budget: int, fixed: float, per_token: float,
               rate: float, load: float) -> int:
    """The most tokens of a prompt with `rest` to go that a step computes: the multiple of `cap`
    (up to `budget`) whose saved steps less the wait it adds is best (module docstring); the cap
    when none saves anything, or when the replica is loaded to its full (load >= 1)."""
    if rest <= cap or load >= 1.0:
        return cap
    t_cap = fixed + per_token * cap

    def expected_s(size: int) -> float:  # seconds added in all (< 0: saved) against the cap
        n = min(size, rest)
        t = fixed + per_token * n
        return rate * t * (t - t_cap) / 2 / (1 - load) - fixed * (math.ceil(n / cap) - 1)
    sizes, size = [], cap
    while size < budget and size < rest:
        size = min(size * 2, budget)
        sizes.append(size)
    best = min(sizes, key=expected_s, default=cap)
    return best if expected_s(best) < 0 else cap
