"""Iteration-level continuous batching (plain values, no torch).

Each step: running requests first (one decode token each, or the next chunk of a prompt),
then waiting requests in arrival order while the token budget, `max_num_seqs` and free
blocks allow. When a running request needs a block and none is free, the most recently
admitted running request is preempted: its blocks are freed and it goes back to the front
of the queue to recompute prompt + output so far. A waiting request whose next prompt block
a running one is still computing (n samples of one prompt, a burst of one system prompt)
waits for it, and then takes it from the prefix cache instead of computing it again; the
requests behind it go ahead meanwhile (at most MAX_DEFERRED of them wait so in one step).
A prompt's last chunk may run over the step's budget by budget // TAIL_FRACTION tokens rather
than leave them for a step of their own, which would cost a whole step's fixed part (weights
read once more) for a few tokens of its time to first token.

`scheduling_policy: priority` (vLLM's): the same, with requests ranked by (priority, arrival)
instead of arrival alone, lower first: running requests take the step's budget and blocks in
that order, the waiting one ranked first is admitted next (and nothing behind it skips it,
unless it waits for blocks being computed),
and the victim of a preemption is the running request ranked last.

`max_step_ms` (a decode replica's ITL SLO): while requests decode, the prompt tokens a step
carries (running prompts' chunks first, then admissions) are cut to what keeps the step's fitted
cost within it, at least MIN_PROMPT_CHUNK, so a long prompt's stall is spread over steps that
each keep the streams' inter-token latency.

`prefill_schedule: ttft` (default), for prefill-only prompts (a prefill replica's, where a step
is what every prompt in it waits on for its first token), within a priority:
- Order: the earliest `arrival + own compute time` first (the step cost's per-token fit times
  the prompt's tokens). A short prompt passes a long one that came before it by less than the
  long one's own compute time; a long one waits at most about that long behind later arrivals.
  The order holds between a prompt's chunks too: a prompt part way through them sits out a
  step when a waiting one comes first (by its arrival + the compute time it has left), so a
  short prompt that arrives during a long one waits for the chunk in progress, not for the
  rest of it (`long_prefill_token_threshold` bounds the chunk). With `ttft_slo_ms` (the app's, on
  the prefill pool), not when the pass alone would make the one passed miss it: a prompt that
  makes the SLO either way, or misses it either way, is passed.
- Chunk size (`chunk_by_arrivals`): a prompt longer than `long_prefill_token_threshold` goes
  in chunks of a multiple of it (up to the budget) where the steps that saves it outweigh the
  wait it adds to the prompts expected to arrive meanwhile (engine/arrivals.py): the budget on a
  quiet replica, the cap under a steady stream of prompts.
- Batch size: a prompt joins the step while what it adds to the step, paid by each of the k
  prompts already finishing in it (k x per_token x its tokens), is less than the fixed cost of
  a step of its own. On a CPU, where a token costs much against the fixed part, that is a few
  short prompts per step, each batch's first tokens out before the next batch starts; on a GPU,
  every prompt the budget holds. Until the step cost is known, arrival order and the budget.

    engine.step():  plan = scheduler.schedule()     # which requests, how many tokens
                    sampled = runner.execute(plan)  # tensors live only there
                    scheduler.update(plan, sampled) # append tokens, finish, free blocks
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable

from cluster.config import SchedulerConfig
from cluster.engine.arrivals import ArrivalWindow, chunk_size
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request, RequestStatus
from cluster.engine.step_cost import StepCost
from cluster.engine.step_plan import ScheduledChunk, StepPlan

MAX_DEFERRED = 64  # waiting requests passed over in one step while their shared blocks compute
MIN_PROMPT_CHUNK = 16  # prompt tokens a step carries at least under `max_step_ms`
TAIL_FRACTION = 16  # a prompt's last chunk may run over the step's budget by budget // this


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 step_cost: StepCost | None = None) -> None:
        self.config = config
        self.blocks = block_manager
        self.step_cost = step_cost if step_cost is not None else StepCost()  # the engine's, fitted per step
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.remote: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self.held: dict[str, Request] = {}  # FINISHED_PREFILLED, blocks kept for hand-off
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.by_priority = config.scheduling_policy == "priority"
        self.for_ttft = config.prefill_schedule == "ttft"
        self.clock = time.monotonic  # what arrival times are measured on
        self.arrivals = ArrivalWindow()  # prefill-only prompts, for chunk_by_arrivals

    # -- admission -----------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.request_id in self.requests or req.request_id in self.held:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)
        if req.prefill_only and self.config.chunk_by_arrivals:
            self.arrivals.add(req.arrival_time, req.num_prompt_tokens, self.clock())

    def add_remote(self, req: Request) -> list[int] | None:
        """Reserve blocks for a prompt whose KV comes from elsewhere; None if they don't fit now.
        The leading blocks the prefix cache holds are shared (they count as computed); returns
        the rest, the blocks the transfer fills."""
        if req.request_id in self.requests or req.request_id in self.held:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        cached = self.blocks.find_cached_prefix(req)[: (req.num_prompt_tokens - 1) // self.blocks.block_size]
        num_cached = len(cached) * self.blocks.block_size
        if not self.blocks.allocate(req, req.num_prompt_tokens - num_cached, cached):
            return None
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[req.request_id] = req
        self.remote[req.request_id] = req
        return req.block_ids[len(cached):]

    def finish_remote(self, request_id: str, ok: bool, recompute: bool = True) -> None:
        """Remote KV landed (ok) → join the running batch; otherwise recompute locally or fail."""
        req = self.remote.pop(request_id)
        req.ready_at = time.monotonic()
        if ok:
            req.num_computed_tokens = req.num_prompt_tokens
            self.blocks.cache_full_blocks(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        elif recompute:
            self._reset_for_recompute(req)
            self.waiting.appendleft(req)
        else:
            self.finish(req, RequestStatus.FINISHED_ERROR)

    # -- one step ------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        if self.by_priority:  # the request ranked last is the tail, where victims come from
            self.running.sort(key=_rank)
        passed = self._passed_over()
        budget, prompt_room = self._continue_running(plan, self.config.max_num_batched_tokens, self._prompt_room(),
                                                     lambda req: req.request_id not in passed)
        if not plan.preempted:
            self._admit_waiting(plan, min(budget, prompt_room), before=min(passed.values(), default=None))
        if passed and plan.is_empty:  # none of the prompts that pass them could start: they go on
            self._continue_running(plan, budget, prompt_room, lambda req: req.request_id in passed)
        now = time.monotonic()
        for chunk in plan.chunks:
            if chunk.request.queue_s is None:
                chunk.request.queue_s = now - chunk.request.ready_at
        return plan

    def _continue_running(self, plan: StepPlan, budget: int, prompt_room: int,
                          this_step: Callable[[Request], bool]) -> tuple[int, int]:
        """Plan the running requests `this_step` takes, in order: a decode token each, or a
        prompt's next chunk; returns what is left of (budget, prompt_room)."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if not this_step(req):
                i += 1
                continue
            rest = req.num_tokens - req.num_computed_tokens
            n = min(rest, budget)
            if n > 1:  # a prompt's chunk (or a preempted request's recompute)
                n = self._chunk(rest, min(budget, prompt_room), self._prompt_chunk(req, rest))
                if n <= 0:
                    i += 1
                    continue
                prompt_room -= n
            if not self._reserve_or_preempt(req, n, plan):
                break
            plan.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
            i += 1
        return budget, prompt_room

    def _chunk(self, rest: int, budget: int, cap: int) -> int:
        """Tokens a step with `budget` left computes of a prompt with `rest` to go, at most `cap`
        of them: all when no more than a sliver (budget // TAIL_FRACTION) would be left for the
        step after, which would cost a step's fixed part for a few tokens (a 1,038-token prompt
        in steps of 512 + 526, not 512 + 512 + 14), else `budget`."""
        budget = min(budget, cap)
        return rest if rest - budget <= budget // TAIL_FRACTION else budget

    def _prompt_chunk(self, req: Request, rest: int) -> int:
        """The most tokens of `req`'s prompt, `rest` to go, a step computes: the cap, or under
        `chunk_by_arrivals` the multiple of it the arrivals make worth it (engine/arrivals.py)."""
        cap = self.config.prompt_chunk
        if rest <= cap or not (self.config.chunk_by_arrivals and req.prefill_only):
            return cap
        cost = self._prompt_cost()
        if cost is None:
            return cap
        rate, load = self.arrivals.seen(self.clock(), *cost)
        return chunk_size(rest, cap, self.config.max_num_batched_tokens, *cost, rate, load)

    def _passed_over(self) -> dict[str, tuple[int, float]]:
        """Under ttft, the prompts part way through their chunks that a waiting prompt goes
        before this step, with their place in the order: those later by arrival + own compute
        time left (the order admission takes, so a short prompt passes a long one between its
        chunks, and a long one that has waited its own compute time is passed no more), and with
        a TTFT SLO, not one the pass alone would make miss it."""
        cost = self._prompt_cost()
        if cost is None or not self.waiting or not any(r.prefill_only for r in self.running):
            return {}
        key = self._ttft_key(cost[1])
        ahead = min((r for r in self.waiting if r.prefill_only), key=key, default=None)
        if ahead is None:
            return {}
        first, slo, now = key(ahead), self.config.ttft_slo_ms / 1e3, self.clock()
        passing = cost[0] + cost[1] * (ahead.num_tokens - ahead.num_computed_tokens)

        def may_pass(req: Request) -> bool:  # unless the pass alone makes it miss the TTFT SLO
            if not slo:
                return True
            rest = req.num_tokens - req.num_computed_tokens
            done = now - req.arrival_time + cost[1] * rest + cost[0] * steps_for(rest, self.config.prompt_chunk)
            return done > slo or done + passing <= slo
        return {r.request_id: key(r) for r in self.running if r.prefill_only and key(r) > first and may_pass(r)}

    def _prompt_room(self) -> int:
        """Prompt tokens this step may carry: under `max_step_ms`, while requests decode, what keeps
        the step's fitted cost within it (never below MIN_PROMPT_CHUNK: a prompt always moves on);
        otherwise the whole budget."""
        budget = self.config.max_num_batched_tokens
        cap_s = self.config.max_step_ms / 1e3
        cost = self.step_cost
        if not cap_s or not cost.resolved or cost.fixed_s is None or not cost.per_token_s:
            return budget
        decoding = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        if not decoding:
            return budget
        return prompt_room(cap_s, cost.fixed_s, cost.per_token_s, decoding, budget)

    def _reserve_or_preempt(self, req: Request, n: int, plan: StepPlan) -> bool:
        while not self.blocks.allocate(req, n):
            victim = self.running.pop()
            self._preempt(victim)
            plan.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, plan: StepPlan, budget: int, before: tuple[int, float] | None = None) -> None:
        """Admit waiting requests in their order while the step has room; under ttft none that
        comes after `before` (a running prompt passed over this step: it goes first next step)."""
        if not self.waiting:  # most decode steps: nothing to admit, nothing to work out
            return
        computing = self._being_computed()
        deferred = 0
        cost = self._prompt_cost()
        finishing = sum(1 for c in plan.chunks if c.request.prefill_only and c.samples)
        key = self._ttft_key(cost[1]) if cost is not None and before is not None else None
        for req in self._admission_order(cost):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or deferred > MAX_DEFERRED:
                break
            if key is not None and key(req) > before:
                break
            cached = None if req.needs_prompt_logprobs else self.blocks.find_cached_prefix(req)  # None: no lookup
            if cached is not None and self._next_block_computing(req, len(cached), computing):
                deferred += 1
                continue
            num_cached = len(cached or []) * self.blocks.block_size
            n = req.num_tokens - num_cached
            if cost is not None and req.prefill_only and finishing and finishing * cost[1] * n > cost[0]:
                break  # cheaper for the prompts in this step to go now, and this one next step
            cap = self._prompt_chunk(req, n)
            if n > min(budget, cap):
                if not self.config.enable_chunked_prefill and plan.chunks:
                    break
                n = self._chunk(n, budget, cap) if self.config.enable_chunked_prefill else n
            if not self.blocks.allocate(req, n, cached):
                break
            self.waiting.remove(req)
            req.num_computed_tokens = num_cached
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.chunks.append(ScheduledChunk(req, num_cached, n))
            budget -= n
            finishing += req.prefill_only and n == req.num_tokens - num_cached
            if cached is not None:
                computing.update(req.block_hashes[len(cached):])

    def _prompt_cost(self) -> tuple[float, float] | None:
        """(fixed, per_token) seconds of a step, for ordering and batching prefill-only prompts
        under `prefill_schedule: ttft`; None: fcfs, or not measured yet, or a token's cost lost in
        the noise of a step's (the fit's fallback, no fixed part: it would batch nothing)."""
        fixed, per_token = self.step_cost.fixed_s, self.step_cost.per_token_s
        if not self.for_ttft or fixed is None or per_token is None or not self.step_cost.resolved:
            return None
        return fixed, per_token

    def _admission_order(self, cost: tuple[float, float] | None) -> list[Request]:
        """Waiting requests in the order they may be admitted: arrival (a preempted one first),
        or by rank under priority; under ttft, prefill-only prompts by arrival + own compute time."""
        if cost is None or not any(r.prefill_only for r in self.waiting):
            return sorted(self.waiting, key=_rank) if self.by_priority else list(self.waiting)
        return sorted(self.waiting, key=self._ttft_key(cost[1]))

    def _ttft_key(self, per_token: float) -> Callable[[Request], tuple[int, float]]:
        """Under ttft: (priority under the priority policy, arrival + the compute time left of a
        prefill-only prompt), earliest first."""
        def key(req: Request) -> tuple[int, float]:
            own = per_token * (req.num_tokens - req.num_computed_tokens) if req.prefill_only else 0.0
            return (req.params.priority if self.by_priority else 0), req.arrival_time + own
        return key

    def _being_computed(self) -> set[bytes]:
        """Hashes of the prompt blocks running requests have yet to compute."""
        if not self.blocks.enable_prefix_caching:
            return set()
        bs = self.blocks.block_size
        return {h for r in self.running if r.num_computed_tokens < r.num_prompt_tokens
                for h in r.block_hashes[r.num_computed_tokens // bs:]}

    def _next_block_computing(self, req: Request, num_cached: int, computing: set[bytes]) -> bool:
        """Whether the first block `req` would compute is one a running request computes now."""
        shareable = (req.num_tokens - 1) // self.blocks.block_size
        return num_cached < min(shareable, len(req.block_hashes)) and req.block_hashes[num_cached] in computing

    def update(self, plan: StepPlan, sampled: dict[str, list[int]]) -> list[Request]:
        """Apply a step's results: per request that sampled, its new tokens (one; with drafts,
        the accepted drafts and the token after them). Tokens after a stop are dropped; blocks
        reserved for rejected drafts go back to the free list. Returns the requests that
        finished (token-level stops)."""
        finished = []
        for chunk in plan.chunks:
            req = chunk.request
            if req.is_finished:  # aborted while the step ran
                continue
            tokens = sampled.get(req.request_id, ())
            # KV is valid for the chunk's known tokens and the drafts accepted (all but the last token)
            computed = chunk.start + chunk.num_tokens - chunk.num_drafts + max(len(tokens) - 1, 0)
            status = None
            for token in tokens:
                req.append_token(token)
                status = req.check_token_stop()
                if status is not None:
                    break
            req.num_computed_tokens = min(computed, req.num_tokens - 1) if tokens else computed
            self.blocks.cache_full_blocks(req)
            if chunk.num_drafts:
                self.blocks.trim(req, req.num_computed_tokens)
            if not tokens:
                continue
            if status is None and req.prefill_only:
                status = RequestStatus.FINISHED_PREFILLED
            if status is not None:
                self.finish(req, status)
                finished.append(req)
        return finished

    # -- endings -------------------------------------------------------------------
    def finish(self, req: Request, status: RequestStatus) -> None:
        """Finish a request in any state; its blocks are freed unless held for hand-off."""
        if req.is_finished:
            return
        prev = req.status
        req.status = status
        if prev == RequestStatus.RUNNING:
            self.running.remove(req)
        elif prev == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.remote.pop(req.request_id, None)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.requests.pop(req.request_id, None)
        if status == RequestStatus.FINISHED_PREFILLED:
            self.held[req.request_id] = req
        else:
            self.blocks.free(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
            return req
        return self.release(request_id)

    def release(self, request_id: str) -> Request | None:
        """Free the blocks a prefill-only request held for its hand-off."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.blocks.free(req)
        return req

    def _preempt(self, req: Request) -> None:
        self._reset_for_recompute(req)
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _reset_for_recompute(self, req: Request) -> None:
        self.blocks.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


def steps_for(tokens: int, budget: int) -> int:
    """Steps of `budget` tokens that `tokens` prompt tokens take, a last sliver folded into the
    step before (Scheduler._chunk); the placement estimates use it."""
    return max(1, math.ceil((tokens - budget // TAIL_FRACTION) / max(1, budget)))


def prompt_room(cap_s: float, fixed_s: float, per_token_s: float, decoding: int, budget: int) -> int:
    """Prompt tokens a step may add beside `decoding` one-token streams and still cost at most
    `cap_s` by the fit `fixed + per_token x tokens` (at least MIN_PROMPT_CHUNK, at most what the
    budget leaves); the decode replica's placement estimates (decode/placement.py) use it too."""
    room = int((cap_s - fixed_s) / per_token_s) - decoding
    return max(MIN_PROMPT_CHUNK, min(room, budget - decoding))


def _rank(req: Request) -> tuple[int, float]:
    """Priority policy: lower priority values first, then earlier arrivals (a preempted
    request keeps its arrival, so it goes back ahead of its peers)."""
    return req.params.priority, req.arrival_time
