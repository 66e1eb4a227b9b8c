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
What 9 steps in 10 of the last TAIL_WINDOW kept to over the fit comes in two parts, by the
length the fit gave each step:
- `tail`, from steps fitted at TAIL_FLOOR_S or more: the TAIL_QUANTILE of their seconds over
  the fit's, a factor, at least 1. A neighbour taking a share of the core stretches a step by
  its length.
- `stall_s`, from shorter steps: the TAIL_QUANTILE of their seconds over the fit, in seconds,
  at least 0. A few ms of another thread holding the GIL, or of the loop taking a burst of
  requests in, is a stall the step waits out whatever its length, not a share of it.
Placement by SLO judges the step that would carry a prompt here at `tail_step_s`, the larger of
the two read on it, so a prompt goes here only when its step keeps the ITL SLO in the tail too.
Read as a share (of the fit, or of a floor of 10 ms), the stalls of a tiny model's ~1-7 ms steps
made the tail 2.3-3.6 after a warm-up; placement scaled a 41 ms local prefill step by it to
147 ms, and sent 36 of a 64-request burst's short prompts to the prefill pool (2026-11-30: the
last first token 0.87 s, against 0.27-0.42 s with every prompt prefilled locally), where the
streams' ITL p99 with all of them local was 26-30 ms. Steps of the default model on this
project's 2-core host are fitted at 21 ms and more: their tail reads as before.
"""

from __future__ import annotations

from collections import deque

DECAY = 0.99
MIN_WEIGHT = 1.9  # observations (decayed: two make 1.99) before anything is said
MIN_SPREAD = 0.25  # weighted variance of tokens-per-step below which the slope is unknown
TAIL_WINDOW = 200  # steps whose cost over the fit `tail` reads
TAIL_QUANTILE = 0.9
MIN_TAIL_STEPS = 20  # fewer steps seen against a fit: `tail` is 1
TAIL_FLOOR_S = 0.01  # steps fitted shorter: their time over the fit is a stall (seconds), not a share


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
        # each step's (seconds the fit gave it, seconds it took), once a fit was there to give them
        self._seen: deque[tuple[float, float]] = deque(maxlen=TAIL_WINDOW)

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step that computed `num_tokens` tokens in `seconds` (engine thread)."""
        if num_tokens <= 0 or seconds < 0:
            return
        d, x, y = self.decay, float(num_tokens), float(seconds)
        if self.per_token_s is not None and self.fixed_s is not None:
            expected = self.fixed_s + self.per_token_s * x
            if expected > 0:
                self._seen.append((expected, y))
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
        """What 9 recent steps in 10 fitted at TAIL_FLOOR_S or more took over the fit (a factor
        >= 1); 1 until MIN_TAIL_STEPS such steps were seen against a fit."""
        seen = list(self._seen)  # a copy: the engine thread appends while others read
        return max(1.0, _quantile([y / fit for fit, y in seen if fit >= TAIL_FLOOR_S], 1.0))

    @property
    def stall_s(self) -> float:
        """What 9 recent steps in 10 fitted under TAIL_FLOOR_S took over the fit, in seconds (>= 0);
        0 until MIN_TAIL_STEPS such steps were seen against a fit."""
        seen = list(self._seen)
        return max(0.0, _quantile([y - fit for fit, y in seen if fit < TAIL_FLOOR_S], 0.0))

    def extra_seconds(self, num_tokens: int) -> float | None:
        """What `num_tokens` more tokens would add to a step; None while the slope is unknown."""
        per_token = self.per_token_s
        return None if per_token is None else per_token * num_tokens


def _quantile(values: list[float], default: float) -> float:
    """TAIL_QUANTILE of `values`; `default` below MIN_TAIL_STEPS of them."""
    if len(values) < MIN_TAIL_STEPS:
        return default
    values.sort()
    return values[min(len(values) - 1, int(TAIL_QUANTILE * len(values)))]
