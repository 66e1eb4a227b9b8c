"""Speculation inside continuous batching: which running requests draft, how many tokens, and
what came of it (plain values, no torch).

    engine.step():  plan = scheduler.schedule()          # one token per decoding request
                    plan = speculator.draft(plan)        # some decode chunks gain drafts
                    result = runner.execute(plan)        # every position of a chunk sampled;
                                                         # drafts verified (sampler._choose_verifying)
                    scheduler.update(plan, result)       # accepted drafts + 1 token appended,
                                                         # blocks of rejected ones freed
                    speculator.observe(plan, result)     # acceptance, counters

A decode chunk drafts when its request is running with its next token known, is not scoring
its prompt, and has room left (max_tokens, max_model_len). Drafts never preempt anyone: when
the blocks they need are not free, or the step's token budget is spent, the chunk runs without.
A constrained (structured output) request's draft ends at the first token its constraint refuses.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Sequence

from cluster.config import SpeculativeConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.step_plan import ScheduledChunk, StepPlan
from cluster.engine.spec.base import Proposer
from cluster.engine.spec.policy import DraftPolicy
from cluster.engine.step_cost import StepCost
from cluster.engine.request import Request

DRAFTING_DECAY = 0.9


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, blocks: BlockManager,
                 step_cost: StepCost, max_batched_tokens: int) -> None:
        self.config = config
        self.proposer = proposer
        self.blocks = blocks
        self.step_cost = step_cost
        self.max_batched_tokens = max_batched_tokens
        self.policy = DraftPolicy(config.num_speculative_tokens, config.adaptive)
        self.counters: Counter[str] = Counter()
        self.accepted_per_pos = [0] * config.num_speculative_tokens
        self.last_lengths: Counter[int] = Counter()  # draft length → requests, in the last step that chose
        self.lengths_chosen: Counter[int] = Counter()  # ... and since start
        self._cost: tuple[float, float] | None = None  # last known (fixed, per_token) fit
        self.drafting_s = 0.0  # seconds per draft position proposed (decayed; ~0 for lookups)

    # -- before the step ----------------------------------------------------------------
    def draft(self, plan: StepPlan) -> StepPlan:
        """The plan with drafts on the decode chunks that speculate."""
        slots = [i for i, c in enumerate(plan.chunks) if self._may_draft(c)]
        if not slots:
            return plan
        reqs = [plan.chunks[i].request for i in slots]
        limits = [self._room(r) for r in reqs]
        proposals: list[list[int]] | None = None
        if self.proposer.cheap:
            proposals = [self._allowed(r, d) for r, d in zip(reqs, self._propose(reqs, limits))]
            limits = [len(p) for p in proposals]
        fit = self._fit()
        lengths = self.policy.choose([r.request_id for r in reqs], limits, plan.num_tokens,
                                     *(fit or (None, None)), self.drafting_s)
        budget = self.max_batched_tokens - plan.num_tokens
        if proposals is not None:
            lengths = [min(k, len(p)) for k, p in zip(lengths, proposals)]
        lengths = self._cap(lengths, budget)
        # never preempts: without free blocks for its drafts, a request runs without them
        lengths = [k if k > 0 and self.blocks.allocate(r, 1 + k) else 0 for r, k in zip(reqs, lengths)]
        if proposals is None:  # a draft model drafts into the blocks just reserved
            proposals = [self._allowed(r, d) for r, d in zip(reqs, self._propose(reqs, lengths))]
        self.last_lengths = Counter(lengths)
        self.lengths_chosen.update(lengths)
        chunks = list(plan.chunks)
        for i, req, k, proposal in zip(slots, reqs, lengths, proposals):
            k = min(k, len(proposal))
            self.blocks.trim(req, req.num_computed_tokens + 1 + k)  # a draft cut short: its spare blocks
            if k > 0:
                chunks[i] = ScheduledChunk(req, chunks[i].start, 1 + k, tuple(proposal[:k]))
        return StepPlan(chunks, plan.preempted)

    def computed(self, plan: StepPlan) -> None:
        """The target computed the plan's KV; a proposer with KV of its own follows."""
        self.proposer.computed(plan.chunks)

    def _propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        """The proposer's drafts, timed: `drafting_s` follows the seconds per draft position."""
        started = time.perf_counter()
        drafts = self.proposer.propose(reqs, limits)
        # a draft model's passes run for every request at once: one pass per position drafted
        positions = max((len(d) for d in drafts), default=0)
        if positions:
            per_position = (time.perf_counter() - started) / positions
            self.drafting_s = per_position if self.drafting_s == 0 else (
                DRAFTING_DECAY * self.drafting_s + (1 - DRAFTING_DECAY) * per_position)
        return drafts

    def _may_draft(self, c: ScheduledChunk) -> bool:
        req = c.request
        return (c.num_tokens == 1 and c.samples and not req.prefill_only
                and req.num_computed_tokens >= req.num_prompt_tokens and not req.needs_prompt_logprobs)

    @staticmethod
    def _room(req: Request) -> int:
        """Drafts that can still be used: the step appends up to k + 1 tokens."""
        left = req.max_model_len - req.num_tokens
        if req.params.max_tokens is not None:
            left = min(left, req.params.max_tokens - req.num_output_tokens)
        return max(left - 1, 0)

    @staticmethod
    def _allowed(req: Request, draft: list[int]) -> list[int]:
        """A constrained request's draft, cut at the first token its constraint refuses."""
        if req.constraint is None or not draft:
            return draft
        return draft[:req.constraint.accepted_prefix(req.output_token_ids, draft)]

    @staticmethod
    def _cap(lengths: Sequence[int], budget: int) -> list[int]:
        out = []
        for k in lengths:
            k = max(min(k, budget), 0)
            budget -= k
            out.append(k)
        return out

    def _fit(self) -> tuple[float, float] | None:
        if self.step_cost.per_token_s is not None and self.step_cost.fixed_s is not None:
            self._cost = (self.step_cost.fixed_s, self.step_cost.per_token_s)
        return self._cost

    # -- after the step -----------------------------------------------------------------
    def observe(self, plan: StepPlan, sampled: dict[str, list[int]]) -> None:
        for c in plan.chunks:
            if not c.num_drafts:
                continue
            accepted = max(len(sampled.get(c.request.request_id, ())) - 1, 0)
            self.policy.observe(c.request.request_id, c.num_drafts, accepted)
            self.counters["spec_num_drafts"] += 1
            self.counters["spec_num_draft_tokens"] += c.num_drafts
            self.counters["spec_num_accepted_tokens"] += accepted
            for pos in range(accepted):
                self.accepted_per_pos[pos] += 1
            c.request.num_draft_tokens += c.num_drafts
            c.request.num_accepted_tokens += accepted

    def finish(self, req: Request) -> None:
        self.proposer.finish(req)

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)
        self.proposer.forget(request_id)

    def stats(self) -> dict[str, Any]:
        drafted = self.counters["spec_num_draft_tokens"]
        return {
            **{k: self.counters[k] for k in ("spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")},
            **{f"spec_accepted_pos_{i}": n for i, n in enumerate(self.accepted_per_pos)},
            "spec_method": self.proposer.name,
            "spec_acceptance_rate": self.counters["spec_num_accepted_tokens"] / drafted if drafted else None,
            "spec_acceptance_estimate": self.policy.engine.rate,
            "spec_drafting_s_per_position": self.drafting_s,
            "spec_lengths_last_step": {str(k): n for k, n in sorted(self.last_lengths.items())},
            "spec_lengths_chosen": {str(k): n for k, n in sorted(self.lengths_chosen.items())},
        }
