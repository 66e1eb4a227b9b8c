"""The pools' autoscaling policies (cluster/autoscaling.py) as Serve runs them: loaded from the
YAML's import path with its policy_kwargs, wrapped in Serve's delays and factors and called with
its AutoscalingContext. (The controller then clips the figure to min/max_replicas.)"""

from __future__ import annotations

import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from cluster.autoscaling import DecodeAutoscaling, PrefillAutoscaling

DEPLOYMENT = DeploymentID(name="PrefillPool", app_name="tandem")


def policy(name: str, **kwargs):
    """The callable Serve's controller builds from a deployment's autoscaling_config."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=0, downscale_delay_s=0,
                               policy={"policy_function": f"cluster.autoscaling:{name}", "policy_kwargs": kwargs})
    config.policy.serialize_policy()
    return _apply_autoscaling_config(_resolve_policy_callable(config.policy)), config


def decide(name: str, replicas: int, metrics: dict[str, list[float]] | None, gone: dict[str, float] | None = None,
           **kwargs) -> int:
    """Replicas asked for: `metrics` maps a key to each running replica's value; `gone`: values
    still reported by a replica that is no longer running."""
    fn, config = policy(name, **kwargs)
    running = [ReplicaID(unique_id=f"r{i}", deployment_id=DEPLOYMENT) for i in range(replicas)]
    aggregated = None
    if metrics is not None:
        aggregated = {key: dict(zip(running, values)) for key, values in metrics.items()}
        for key, value in (gone or {}).items():
            aggregated[key][ReplicaID(unique_id="old", deployment_id=DEPLOYMENT)] = value
    ctx = AutoscalingContext(
        deployment_id=DEPLOYMENT, deployment_name=DEPLOYMENT.name, app_name="tandem",
        current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=running,
        total_num_requests=1.0, total_queued_requests=0.0, aggregated_metrics=aggregated, raw_metrics=None,
        capacity_adjusted_min_replicas=config.min_replicas, capacity_adjusted_max_replicas=config.max_replicas,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=None, config=config)
    desired, _ = fn(ctx)
    return desired


def test_the_prefill_pool_scales_on_the_prompt_tokens_it_has_to_compute():
    assert decide("PrefillAutoscaling", 1, {"queued_tokens": [5000]}, target_queued_tokens=2048) == 3
    assert decide("PrefillAutoscaling", 3, {"queued_tokens": [100, 0, 0]}, target_queued_tokens=2048) == 1
    assert decide("PrefillAutoscaling", 1, {"queued_tokens": [60000]}, target_queued_tokens=2048) == 30
    assert decide("PrefillAutoscaling", 2, {"queued_tokens": [0, 0]}) == 1  # idle (Serve goes to 0 only from 1)
    # a replica that has left the pool no longer counts
    assert decide("PrefillAutoscaling", 1, {"queued_tokens": [1000]}, gone={"queued_tokens": 9000}) == 1


def test_the_decode_pool_scales_on_requests_or_kv_memory_whichever_needs_more():
    full = {"requests": [10, 10], "blocks_in_use": [950, 950], "num_blocks": [1000, 1000]}
    assert decide("DecodeAutoscaling", 2, full, target_requests=32, target_kv_usage=0.8) == 3  # 2 x 0.95 / 0.8
    busy = {"requests": [70, 50], "blocks_in_use": [100, 100], "num_blocks": [1000, 1000]}
    assert decide("DecodeAutoscaling", 2, busy, target_requests=32) == 4  # 120 / 32
    quiet = {"requests": [1, 0], "blocks_in_use": [10, 0], "num_blocks": [1000, 1000]}
    assert decide("DecodeAutoscaling", 2, quiet) == 1  # 2 x 0.005 / 0.8, and 1 / 32


def test_before_any_report_a_pool_keeps_its_target():
    assert decide("PrefillAutoscaling", 2, None) == 2
    assert decide("DecodeAutoscaling", 3, {"requests": [], "blocks_in_use": [], "num_blocks": []}) == 3


def test_bad_targets_are_refused_by_name():
    with pytest.raises(ValueError, match="target_queued_tokens"):
        PrefillAutoscaling(target_queued_tokens=0)
    with pytest.raises(ValueError, match="target_requests"):
        DecodeAutoscaling(target_requests=1.5)
    with pytest.raises(ValueError, match="target_kv_usage"):
        DecodeAutoscaling(target_kv_usage=1.5)
