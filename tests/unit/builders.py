"""Shared builders for torch-free scheduler and block-manager tests."""

from __future__ import annotations

import itertools

from cluster.config import SchedulerConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.scheduler import Scheduler
from cluster.request import Request
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
