"""Shared builders for torch-free scheduler and block-manager tests."""

from __future__ import annotations

import itertools
import random

from cluster.config import SchedulerConfig, SpeculativeConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.scheduler import Scheduler
from cluster.engine.spec.base import Proposer
from cluster.engine.spec.speculator import Speculator
from cluster.engine.step_cost import StepCost
from cluster.engine.request import Request
from cluster.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(prompt_len: int = 10, max_tokens: int = 8, *, prompt: list[int] | None = None,
                 max_model_len: int = 4096, **params: object) -> Request:
    n = next(_ids)
    tokens = prompt if prompt is not None else [1 + (n * 31 + i * 7) % 97 for i in range(prompt_len)]
    return Request(f"r{n}", list(tokens), SamplingParams(max_tokens=max_tokens, **params),
                   max_model_len, frozenset({0}))


def make_scheduler(num_blocks: int = 64, block_size: int = 4, *, prefix_caching: bool = True,
                   **config: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size, prefix_caching))


def run_step(sched: Scheduler, token: int = 5):
    """One fake model step: every chunk that samples gets `token`."""
    plan = sched.schedule()
    sampled = {c.request.request_id: [token] for c in plan.chunks if c.samples}
    finished = sched.update(plan, sampled)
    return plan, finished


class ScriptedProposer(Proposer):
    """Drafts `pattern`-following tokens: token t is followed by t + 1 (torch-free tests)."""

    name = "scripted"

    def propose(self, requests, limits):
        return [[r.token_ids[-1] + 1 + i for i in range(k)] for r, k in zip(requests, limits)]


def make_speculator(sched: Scheduler, k: int = 4, proposer: Proposer | None = None) -> Speculator:
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=k, adaptive=False)
    return Speculator(config, proposer or ScriptedProposer(), sched.blocks, StepCost(),
                      sched.config.max_num_batched_tokens)


def run_spec_step(sched: Scheduler, spec: Speculator, rng: random.Random, token: int = 5):
    """One fake model step with drafts: each draft run accepts a random prefix, then `token`."""
    plan = spec.draft(sched.schedule())
    sampled = {}
    for c in plan.chunks:
        if c.samples:
            accepted = rng.randint(0, c.num_drafts)
            sampled[c.request.request_id] = [*c.draft_token_ids[:accepted], token]
    finished = sched.update(plan, sampled)
    spec.observe(plan, sampled)
    return plan, finished
