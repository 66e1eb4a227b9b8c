"""Every file in configs/ validates (Serve schema + strict keys; cluster.yaml through Ray's
autoscaler checks), and a typo'd key fails with its name."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from cluster.serve_config import ConfigError, validate_serve_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SERVE_FILES = sorted(p.name for p in CONFIGS.glob("*.yaml") if p.name != "cluster.yaml")


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


@pytest.mark.parametrize("name", SERVE_FILES)
def test_every_serve_config_validates(name):
    apps = validate_serve_config(CONFIGS / name)
    assert len(apps) == 1
    assert apps[0].mode == ("colocated" if name == "colocated.yaml" else "disaggregated")


def test_one_file_per_connector_and_a_default():
    connectors = {validate_serve_config(CONFIGS / n)[0].kv_transfer.connector
                  for n in SERVE_FILES if n != "colocated.yaml"}
    from cluster.app_config import KV_CONNECTORS

    assert connectors == set(KV_CONNECTORS)  # every connector has its own file
    assert validate_serve_config(CONFIGS / "serve.yaml")[0].kv_transfer.connector == "shared_store"


@pytest.mark.parametrize("mutate,named", [
    (lambda c: c["applications"][0]["deployments"][1].update(num_replica=2), "num_replica"),
    (lambda c: c["applications"][0]["deployments"][2]["ray_actor_options"].update(num_cpu=1), "num_cpu"),
    (lambda c: c["applications"][0].update(rout_prefix="/"), "rout_prefix"),
    (lambda c: c["http_options"].update(prot=1), "prot"),
    (lambda c: c["applications"][0]["args"].update(modle="x"), "modle"),
    (lambda c: c["applications"][0]["args"]["engine"].update(max_num_seq=4), "max_num_seq"),
    (lambda c: c["applications"][0]["args"]["kv_transfer"].update(conector="tcp"), "conector"),
    (lambda c: c["applications"][0]["deployments"].append({"name": "PrefilPool"}), "PrefilPool"),
    (lambda c: c["applications"][0]["args"].update(speculative_config={"method": "ngram", "num_spec_tokens": 3}),
     "num_spec_tokens"),
    (lambda c: c["applications"][0]["args"].update(speculative_config={"method": "eagle3"}), "eagle3"),
])
def test_a_typo_fails_with_its_name(mutate, named):
    config = copy.deepcopy(load("serve.yaml"))
    mutate(config)
    with pytest.raises(ConfigError, match=named):
        validate_serve_config(config)


def test_the_commented_speculative_config_validates_once_uncommented():
    text = (CONFIGS / "serve.yaml").read_text()
    lines = [line.replace("# ", "", 1) if "speculative_config:" in line or line.strip().startswith(("#   method:", "#   num_spec"))
             else line for line in text.splitlines()]
    config = yaml.safe_load("\n".join(lines))
    spec = validate_serve_config(config)[0].engine.speculative
    assert spec is not None and (spec.method, spec.num_speculative_tokens, spec.adaptive) == ("ngram", 5, True)


def test_bad_values_are_refused():
    config = load("serve.yaml")
    config["applications"][0]["args"]["kv_transfer"]["connector"] = "carrier-pigeon"
    with pytest.raises(ConfigError, match="carrier-pigeon"):
        validate_serve_config(config)
    tcp = load("serve-tcp.yaml")
    tcp["applications"][0]["args"]["kv_transfer"]["prefault_object_store"] = True
    with pytest.raises(ConfigError, match="prefault_object_store applies to the shared_store connector only"):
        validate_serve_config(tcp)
    store = load("serve.yaml")
    store["applications"][0]["args"]["kv_transfer"]["prefault_object_store"] = "yes"
    with pytest.raises(ConfigError, match="prefault_object_store must be true or false"):
        validate_serve_config(store)
    store["applications"][0]["args"]["kv_transfer"]["prefault_object_store"] = False
    store["applications"][0]["args"]["prefix_aware_routing"] = "no"
    with pytest.raises(ConfigError, match="prefix_aware_routing must be true or false"):
        validate_serve_config(store)
    scaled = load("serve-autoscaling.yaml")
    policy = scaled["applications"][0]["deployments"][1]["autoscaling_config"]["policy"]
    policy["policy_function"] = "cluster.autoscaling:PrefilAutoscaling"
    with pytest.raises(ConfigError, match="has no attribute 'PrefilAutoscaling'"):  # Ray's schema imports it
        validate_serve_config(scaled)
    policy.update(policy_function="cluster.autoscaling:PrefillAutoscaling", policy_kwargs={"target_queued_tokens": 0})
    with pytest.raises(ConfigError, match="PrefillPool.*target_queued_tokens must be a positive integer"):
        validate_serve_config(scaled)
    policy["policy_kwargs"] = {"target_queue_tokens": 2048}
    with pytest.raises(ConfigError, match="target_queue_tokens"):
        validate_serve_config(scaled)
    colocated = load("colocated.yaml")
    colocated["applications"][0]["deployments"].append({"name": "PrefillPool", "num_replicas": 1})
    with pytest.raises(ConfigError, match="PrefillPool"):
        validate_serve_config(colocated)


def test_the_grpc_block_of_serve_yaml_validates_once_uncommented():
    lines = (CONFIGS / "serve.yaml").read_text().splitlines()
    start = lines.index("# grpc_options:")
    block = [line[2:] for line in lines[start:] if line.startswith("#   ") or line == "# grpc_options:"]
    config = {**load("serve.yaml"), **yaml.safe_load("\n".join(block))}
    validate_serve_config(config)
    from cluster.router import grpc_api

    assert config["grpc_options"]["grpc_servicer_functions"] == [grpc_api.SERVICER]

    config["grpc_options"]["grpc_servicer_functions"] = ["cluster.router.grpc_servicer.add_tandem_servicr"]
    with pytest.raises(ConfigError, match="add_tandem_servicr"):
        validate_serve_config(config)
    config["grpc_options"] = {"port": 9000, "grpc_servicer_funcions": []}
    with pytest.raises(ConfigError, match="grpc_servicer_funcions"):
        validate_serve_config(config)


def test_cluster_yaml_passes_ray_autoscaler_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = load("cluster.yaml")
    validate_config(raw)
    prepared = prepare_config(copy.deepcopy(raw))
    validate_config(prepared)
    assert set(prepared["available_node_types"]) == {"head", "cpu_worker", "gpu_worker"}
    assert any("make install" in cmd for cmd in prepared["setup_commands"])
    broken = copy.deepcopy(raw)
    broken["available_node_types"]["cpu_worker"]["min_worker"] = 1
    with pytest.raises(Exception, match="min_worker"):
        validate_config(broken)
