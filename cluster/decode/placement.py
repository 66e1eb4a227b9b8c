"""Where a disaggregated request's prompt is computed: on the prefill pool, or here on its
decode replica, chosen per request against the app's SLOs (`ttft_slo_ms`, `itl_slo_ms`) from
costs both pools measure (plain values, no torch).

                 time to first token                              running streams' ITL
    remote       prefill queue + own prompt on a prefill replica  unchanged
                 + hand-off + one decode step to join
    local        this replica's queue + own prompt, in steps      each step it shares grows by
                 of `max_num_batched_tokens` beside the streams,  its prompt tokens' cost: at
                 or, with SchedulerConfig.max_step_ms set, of     most up to max_step_ms, when
                 what keeps a step within it while they decode    the engine cuts steps to it

A step costs `fixed + per_token x tokens` (engine/step_cost.py, each pool its own fit); the
step that would carry R's prompt here is judged at what 9 recent steps in 10 cost over their fit
(`StepCosts.tail_step_s`: a share of a long step, a stall added to a short one's), since a few ms
over the ITL SLO on a busy host is a stall every stream sees. The choice: of the placements that keep both SLOs, the one with the earlier first token, except that
a prompt the streams' steps would carry in several cut steps goes remote when remote keeps the
SLOs too (the prefill pool is there to spare the streams that stall; here it is the rescue for a
prompt the pool's queue would make late); when neither keeps both, the one that breaks fewer
requests' SLOs (here: every stream whose ITL R's steps would break, those decoding and those
bound here, queued or their KV on its way, and R if its first token is late; there: R if
late), and of two that break as many, the one that breaks them least (the larger of TTFT /
TTFT SLO and ITL / ITL SLO). Unknown costs (a pool not measured yet): remote, as without SLOs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from cluster.engine.scheduler import prompt_room, steps_for


@dataclass(frozen=True)
class StepCosts:
    """A pool's fitted step cost, seconds; what 9 recent steps in 10 ran over the fit: `tail`, a
    factor (steps fitted at 10 ms or more), and `stall_s`, seconds (shorter steps): StepCost."""

    fixed_s: float
    per_token_s: float
    tail: float = 1.0
    stall_s: float = 0.0

    def step_s(self, tokens: float) -> float:
        return self.fixed_s + self.per_token_s * tokens

    def tail_step_s(self, tokens: float) -> float:
        """A step of `tokens` as 9 in 10 ran lately: stretched by the tail, or stalled."""
        step = self.step_s(tokens)
        return max(step * self.tail, step + self.stall_s)


@dataclass(frozen=True)
class PrefillPoolView:
    """The prefill pool as its replicas last posted it, plus what this replica sent since."""

    costs: StepCosts
    queued: tuple[int, ...]  # each queued prompt's tokens to compute, over the pool
    replicas: int
    step_budget: int  # a prefill step's max_num_batched_tokens
    running: tuple[int, ...] = ()  # the rest of each prompt part way through its chunks
    chunk: int = 0  # one prompt's tokens in a step at most (SchedulerConfig.prompt_chunk); 0: step_budget
    #                 (with chunk_by_arrivals a quiet pool takes bigger chunks: it is read as the cap,
    #                 the size the pool keeps to when prompts come often enough to queue)
    passes_running: bool = False  # a shorter prompt passes one part way through its chunks
    #                               (prefill_schedule ttft), else that one runs to its end first

    @property
    def prompt_chunk(self) -> int:
        return self.chunk or self.step_budget

    def ahead_of(self, tokens: int) -> float:
        """Prompt tokens a new prompt of `tokens` waits for on one replica: the shorter ones
        queued (they go first: engine/scheduler.py, prefill_schedule ttft); of those part way
        through their chunks, when a prompt passes them, the shorter ones and the chunk in
        progress of the longest, else the rest of all (they run to their end first)."""
        shorter = sum(w for w in self.queued if w <= tokens)
        if not self.passes_running:
            return (shorter + sum(self.running)) / max(1, self.replicas)
        shorter += sum(w for w in self.running if w <= tokens)
        in_step = max((min(w, self.prompt_chunk) for w in self.running if w > tokens), default=0)
        return (shorter + in_step) / max(1, self.replicas)

    def plus_sent(self, sent: Sequence[int]) -> PrefillPoolView:
        """This view with prompts sent since it was posted (tokens each, in the order sent): on a
        replica with nothing running or queued a prompt started at once; the rest wait, the
        shorter first."""
        idle = 0 if self.queued else max(0, self.replicas - len(self.running))
        return replace(self, running=self.running + tuple(sent[:idle]), queued=self.queued + tuple(sent[idle:]))


@dataclass(frozen=True)
class PlacementInputs:
    uncached_tokens: int  # R's prompt tokens this replica's prefix cache does not hold
    decode: StepCosts | None  # this replica's step cost; None until measured
    running: int  # streams decoding here (one token each per step)
    waiting_tokens: int  # prompt tokens queued here ahead of R
    step_budget: int  # max_num_batched_tokens
    prefill: PrefillPoolView | None  # None: no fresh report from the prefill pool
    handoff_s: float  # what a hand-off costs beyond the pool's queue and compute, recently: the
    #                   calls to the pool and back, the KV's send and receive
    max_step_s: float = 0.0  # the engine's cap on a step while streams decode (0: none)
    chunk: int = 0  # one prompt's tokens in a step at most here (long_prefill_token_threshold); 0: step_budget
    coming: int = 0  # requests bound for this replica not decoding yet: queued here, or their KV on its
    #                  way from the prefill pool (they join the streams R's steps would stall)


@dataclass(frozen=True)
class Placement:
    where: str  # "local" | "remote"
    reason: str
    local_ttft_s: float | None = None
    local_itl_s: float | None = None
    remote_ttft_s: float | None = None
    itl_s: float | None = None  # the streams' step without R's prompt

    def trace(self) -> dict[str, object]:
        """What the request trace shows of the decision (ms)."""
        ms = {k: round(v * 1e3, 1) for k, v in (("local_ttft_ms", self.local_ttft_s), ("local_itl_ms", self.local_itl_s),
                                                  ("remote_ttft_ms", self.remote_ttft_s), ("itl_ms", self.itl_s))
              if v is not None}
        return {"placement": self.where, "placement_reason": self.reason, **ms}


def local_steps(inp: PlacementInputs) -> tuple[int, int]:
    """(prompt tokens per step beside the running streams, steps until R's first token) here."""
    d = inp.decode
    assert d is not None
    room = max(1, inp.step_budget - inp.running)
    if inp.max_step_s and inp.running and d.per_token_s > 0:  # as the scheduler cuts them
        room = prompt_room(inp.max_step_s, d.fixed_s, d.per_token_s, inp.running, inp.step_budget)
    if inp.chunk:
        room = min(room, inp.chunk)
    return room, steps_for(inp.waiting_tokens + inp.uncached_tokens, room)


def estimate_local(inp: PlacementInputs) -> tuple[float, float]:
    """(TTFT, the streams' ITL meanwhile) if R is prefilled here: the queued prompts and R's run
    in steps of `step_budget` tokens (or fewer, cut to the ITL SLO), each also carrying a token
    per running stream; the ITL at the replica's tail (StepCosts.tail_step_s), the TTFT at its fit."""
    d = inp.decode
    assert d is not None
    room, steps = local_steps(inp)
    prompt = inp.waiting_tokens + inp.uncached_tokens
    ttft = steps * d.fixed_s + d.per_token_s * (prompt + steps * inp.running)
    itl = d.tail_step_s(inp.running + min(prompt, room))
    return ttft, itl


def estimate_remote(inp: PlacementInputs) -> float:
    """TTFT if R goes to the prefill pool: its share of the pool's queue, R's own step, the
    hand-off around them (the calls, the KV's transfer), and one decode step to join here."""
    p, d = inp.prefill, inp.decode
    assert p is not None and d is not None
    work = p.ahead_of(inp.uncached_tokens) + inp.uncached_tokens
    steps = steps_for(work, p.prompt_chunk)
    return steps * p.costs.fixed_s + p.costs.per_token_s * work + inp.handoff_s + d.step_s(inp.running)


def place(inp: PlacementInputs, ttft_slo_s: float | None, itl_slo_s: float | None) -> Placement:
    if inp.decode is None or inp.prefill is None:
        return Placement("remote", "costs not measured yet")
    local_ttft, local_itl = estimate_local(inp)
    remote_ttft = estimate_remote(inp)
    itl_now = inp.decode.step_s(inp.running)
    ttft_slo, itl_slo = ttft_slo_s or math.inf, itl_slo_s or math.inf
    seen = dict(local_ttft_s=local_ttft, local_itl_s=local_itl, remote_ttft_s=remote_ttft, itl_s=itl_now)
    local_ok = local_ttft <= ttft_slo and local_itl <= itl_slo
    remote_ok = remote_ttft <= ttft_slo
    if local_ok and remote_ok:
        if inp.running and inp.uncached_tokens > local_steps(inp)[0]:
            return Placement("remote", "both keep the SLOs: remote spares the streams a stall of several steps", **seen)
        where = "local" if local_ttft < remote_ttft else "remote"
        return Placement(where, "both keep the SLOs: the earlier first token", **seen)
    if local_ok or remote_ok:
        return Placement("local" if local_ok else "remote", "only this one keeps the SLOs", **seen)
    # Neither keeps both. There, one request's SLO breaks: R's first token is late. Here, R's if
    # late, and the ITL of every stream R's slow steps would carry: those decoding and those bound
    # here that join them meanwhile (with none, the one that arrives counts): a stall of 16
    # streams is not one breach.
    broken_here = int(local_ttft > ttft_slo) + (max(inp.running + inp.coming, 1) if local_itl > itl_slo else 0)
    if broken_here > 1:
        return Placement("remote", "neither keeps the SLOs: here would break more requests", **seen)
    local_breach = max(local_ttft / ttft_slo, local_itl / itl_slo)
    remote_breach = max(remote_ttft / ttft_slo, itl_now / itl_slo)
    return Placement("local" if local_breach < remote_breach else "remote", "neither keeps the SLOs: the smaller breach",
                     **seen)

