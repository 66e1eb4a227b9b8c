"""Autoscaling each pool on what load means for it (Serve custom autoscaling policies).

Serve's default policy scales on ongoing requests per replica. For a prefill replica that says
little: one request may be 20 prompt tokens or 4,000. For a decode replica it misses memory: a
few long requests can fill its KV cache. So each pool replica reports its own load with
`record_autoscaling_stats` (cluster/pool_replica.py), and a pool deployed with one of these
policies asks Serve for as many replicas as that load needs:

    PrefillAutoscaling  ceil(prompt tokens queued to compute, over the pool / target_queued_tokens)
                        (what a new prompt waits behind: the TTFT the pool adds)
    DecodeAutoscaling   ceil(max(requests on the pool / target_requests,
                                 replicas now x KV-cache usage / target_kv_usage))

In YAML, under a pool's deployment:

    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      policy: {policy_function: cluster.autoscaling:PrefillAutoscaling,
               policy_kwargs: {target_queued_tokens: 2048}}

Serve applies the rest of the `autoscaling_config` around the figure: min/max_replicas,
upscale/downscale delays and factors, and averages each metric over `look_back_period_s`.
A pool whose replicas have not reported yet keeps its current target.
"""

from __future__ import annotations

import math
from typing import Any

# record_autoscaling_stats() keys (numbers only, as Serve requires)
QUEUED_TOKENS = "queued_tokens"  # prefill: uncached prompt tokens queued or being computed
REQUESTS = "requests"  # decode: running + waiting + waiting for their KV
BLOCKS_IN_USE = "blocks_in_use"  # decode
NUM_BLOCKS = "num_blocks"  # decode


def _pool_sum(ctx: Any, key: str) -> float | None:
    """The metric summed over the running replicas (each averaged over the look-back period);
    None until any replica has reported it."""
    per_replica = (ctx.aggregated_metrics or {}).get(key)
    running = set(ctx.running_replicas)
    values = [v for replica, v in (per_replica or {}).items() if replica in running]
    return float(sum(values)) if values else None


class PrefillAutoscaling:
    def __init__(self, target_queued_tokens: int = 2048) -> None:
        if not isinstance(target_queued_tokens, int) or target_queued_tokens < 1:
            raise ValueError(f"target_queued_tokens must be a positive integer, got {target_queued_tokens!r}")
        self.target_queued_tokens = target_queued_tokens

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        queued = _pool_sum(ctx, QUEUED_TOKENS)
        if queued is None:
            return ctx.target_num_replicas, {}
        return math.ceil(queued / self.target_queued_tokens), {}


class DecodeAutoscaling:
    def __init__(self, target_requests: int = 32, target_kv_usage: float = 0.8) -> None:
        if not isinstance(target_requests, int) or target_requests < 1:
            raise ValueError(f"target_requests must be a positive integer, got {target_requests!r}")
        if not 0 < target_kv_usage <= 1:
            raise ValueError(f"target_kv_usage must be in (0, 1], got {target_kv_usage!r}")
        self.target_requests = target_requests
        self.target_kv_usage = target_kv_usage

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        requests, used, blocks = (_pool_sum(ctx, k) for k in (REQUESTS, BLOCKS_IN_USE, NUM_BLOCKS))
        if requests is None or used is None or not blocks:
            return ctx.target_num_replicas, {}
        by_requests = requests / self.target_requests
        by_memory = ctx.current_num_replicas * (used / blocks) / self.target_kv_usage
        return math.ceil(max(by_requests, by_memory)), {}
