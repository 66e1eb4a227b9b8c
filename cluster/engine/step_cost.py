"""What one more token in a step costs this engine, measured from its own steps.

Every step's wall time is a fixed part (weights streamed once, launch overheads) plus a part
per token computed (a matmul row each, its attention). `StepCost` fits

    step_seconds ≈ fixed + per_token * tokens_in_step

by least squares over recent steps, each older step weighing `DECAY` times the one after it
(~1/(1-DECAY) steps of memory), so the fit follows a host that speeds up or slows down. The
decode replica asks it what prefilling `n` prompt tokens here would add to its running
streams' next step: `extra_seconds(n) = per_token * n` (conditional disaggregation by time,
`local_prefill_budget_ms`).

Steps that all computed the same number of tokens (a single stream: 1 each) say nothing about
the split between the two parts; until the window holds steps of at least two sizes the slope
is unknown and `per_token_s` is None. `LLMEngine.calibrate` runs two steps of different sizes
so a new replica knows its slope before its first request.

The fit is a mean; a replica sharing its host with other processes runs some steps well over it
(on the 2-core host of docs/performance.md, local prefills estimated at ~145 ms ran to ~180).
`tail` is what 9 steps in 10 of the last TAIL_WINDOW kept to: the TAIL_QUANTILE of each step's
seconds over what the fit said before it, at least 1. Placement by SLO scales the step that
would carry a prompt here by it, so a prompt goes here only when its step keeps the ITL SLO in
the tail too. A step's time over its fit is read against at least TAIL_FLOOR_S: a stall of a few
ms is a share of a long step but not of a short one. Read against the fit alone, the ~1 ms steps
of a tiny model that stalled now and then by a few tens of ms made the tail 28-38, and placement
judged local prefill steps of 4-17 ms at 158-500 ms: a 64-request burst of bench/dataplane.py sent
every prompt to the prefill pool. Steps of the default model on this project's 2-core host are
fitted at 21 ms and more, over the floor: their tail reads as before.
"""

from __future__ import annotations

from collections import deque

DECAY = 0.99
MIN_WEIGHT = 1.9  # observations (decayed: two make 1.99) before anything is said
MIN_SPREAD = 0.25  # weighted variance of tokens-per-step below which the slope is unknown
TAIL_WINDOW = 200  # steps whose cost over the fit `tail` reads
TAIL_QUANTILE = 0.9
MIN_TAIL_STEPS = 20  # fewer steps seen against a fit: `tail` is 1
TAIL_FLOOR_S = 0.01  # a step's time over its fit is read as a share of at least this


class StepCost:
    def __init__(self, decay: float = DECAY) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.reset()

    def reset(self) -> None:
        """Forget every step seen (in place: the scheduler and the speculator hold this object)."""
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.per_token_s: float | None = None  # the fitted slope; None: not known yet
        self.fixed_s: float | None = None  # the fitted intercept, known with the slope
        self.resolved = False  # the window tells a token's cost from a step's (a slope > 0 found)
        self.steps = 0
        self._over: deque[float] = deque(maxlen=TAIL_WINDOW)  # each step's 1 + (s over the fit) / max(fit, floor)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step that computed `num_tokens` tokens in `seconds` (engine thread)."""
        if num_tokens <= 0 or seconds < 0:
            return
        d, x, y = self.decay, float(num_tokens), float(seconds)
        if self.per_token_s is not None and self.fixed_s is not None:
            expected = self.fixed_s + self.per_token_s * x
            if expected > 0:
                self._over.append(1.0 + (y - expected) / max(expected, TAIL_FLOOR_S))
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.steps += 1
        fit = self._fit()
        if fit is None:
            self.per_token_s = None  # one assignment: readers on other threads see old or new
            self.resolved = False
        else:
            self.fixed_s, self.per_token_s, self.resolved = fit

    def _fit(self) -> tuple[float, float, bool] | None:
        """(fixed, per_token, resolved), or None while the window cannot tell them apart."""
        if self._w < MIN_WEIGHT:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x < MIN_SPREAD:
            return None
        slope = (self._xy / self._w - mean_x * mean_y) / var_x
        if slope > 0:
            return max(mean_y - slope * mean_x, 0.0), slope, True
        # noise can tilt a fit over a narrow spread below zero (a token costs less than the noise
        # in a step: a tiny model, a GPU); a token never costs nothing, and the average cost per
        # token (fixed part included) is an upper bound to fall back on. `resolved` says so.
        return 0.0, mean_y / mean_x, False

    @property
    def tail(self) -> float:
        """What 9 recent steps in 10 cost over the fit (a factor >= 1); 1 until MIN_TAIL_STEPS
        steps were seen against a fit."""
        over = list(self._over)  # a copy: the engine thread appends while others read
        if len(over) < MIN_TAIL_STEPS:
            return 1.0
        over.sort()
        return max(1.0, over[min(len(over) - 1, int(TAIL_QUANTILE * len(over)))])

    def extra_seconds(self, num_tokens: int) -> float | None:
        """What `num_tokens` more tokens would add to a step; None while the slope is unknown."""
        per_token = self.per_token_s
        return None if per_token is None else per_token * num_tokens
