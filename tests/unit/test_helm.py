"""The Helm chart (helm/tandem) renders and lints offline, its values schema refuses typos, and
what it renders is what Kubernetes, KubeRay and Tandem accept.

Rendering is helm-python-sdk: Helm v4's engine through its C ABI (no helm binary, no cluster, no
network); `Chart.render` applies values.schema.json first, as `helm install` does. Each render is
then checked three ways:
  - every pod template (head and each worker group) by kubernetes-validate, strict, wrapped as a
    v1 PodTemplate;
  - the RayService around them against helm/tandem/ci/rayservice.schema.json (KubeRay's CRD is
    not vendored; that schema closes every object the chart writes, so a misspelled field fails
    here instead of being pruned by the API server);
  - serveConfigV2 by cluster.serve_config.validate_serve_config, the check `make serve` applies
    to configs/ (Ray's ServeDeploySchema, strict keys, Tandem's AppConfig).

The kuberay-operator dependency is declared, not vendored: charts/ comes from `helm dependency
build`, which needs the network. `Chart.render` does not check dependencies (the CLI's install
does, even for a disabled one), so the chart renders as it is. `lint` reports the missing chart
as a warning, so the strict lint runs on a copy whose Chart.yaml drops `dependencies`, and a stub
kuberay-operator subchart in another copy shows that the condition switches the operator.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster.router import grpc_api
from cluster.serve_config import validate_serve_config

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "tandem"
RAYSERVICE_SCHEMA = json.loads((CHART / "ci" / "rayservice.schema.json").read_text())
KUBE_VERSION = "1.30.0"  # a version kubernetes-validate ships schemas for (1.25 to 1.37)

OVERRIDES = {
    "args": {"model": "/models/Llama-3.2-1B-Instruct", "served_model_name": "llama",
             "kv_transfer": {"connector": "tcp", "host": "0.0.0.0"},
             "speculative_config": {"method": "suffix", "num_speculative_tokens": 4}},
    "prefill": {"num_replicas": 2, "max_queued_requests": 1000000,
                "ray_actor_options": {"num_cpus": 2, "resources": {"cpu_pool": 1}}},
    "decode": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "policy": {
                   "policy_function": "cluster.autoscaling:DecodeAutoscaling", "policy_kwargs": {"target_requests": 16}}},
               "ray_actor_options": {"num_cpus": 1, "num_gpus": 1}},
    "workers": {"gpu": {"enabled": True, "replicas": 1},
                "cpu": {"rayStartParams": {"resources": '"{\\"cpu_pool\\": 1}"'}}},
    "apiKey": {"secretName": "tandem-api", "secretKey": "token"},
    "modelVolume": {"persistentVolumeClaim": "hf-models"},
    "image": {"repository": "registry.example/tandem", "tag": "v1"},
    "grpc": {"enabled": True, "port": 9443},
}
COLOCATED = {"args": {"mode": "colocated"}, "decode": {"num_replicas": 2}}
VALUE_SETS = {"defaults": {}, "overrides": OVERRIDES, "colocated": COLOCATED}


def render(values: dict | None = None, chart: Path = CHART, name: str = "demo") -> dict[str, str]:
    with helm.Chart.load(chart) as loaded:
        return loaded.render(values, name=name, namespace="serving")


def rayservice(values: dict | None = None, **kwargs) -> dict:
    docs = [d for path, text in render(values, **kwargs).items() if path.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]
    assert [d["kind"] for d in docs] == ["RayService"]
    return docs[0]


def serve_config(rs: dict) -> dict:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def deployments(rs: dict) -> dict[str, dict]:
    return {d["name"]: d for d in serve_config(rs)["applications"][0]["deployments"]}


def pod_templates(rs: dict) -> dict[str, dict]:
    cluster = rs["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}
    return {"head": cluster["headGroupSpec"]["template"], **groups}


def chart_copy(tmp_path: Path) -> Path:
    """The chart as checked out: without the charts/ a local `helm dependency build` leaves."""
    copy = tmp_path / "tandem"
    shutil.copytree(CHART, copy, ignore=shutil.ignore_patterns("charts"))
    return copy


def strip_dependencies(chart: Path) -> None:
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    del meta["dependencies"]
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta, sort_keys=False))


# -- render and lint ---------------------------------------------------------------------------

def test_lints_clean_and_renders_one_rayservice(tmp_path):
    chart = chart_copy(tmp_path)
    report = helm.lint(chart, kube_version=f"v{KUBE_VERSION}")
    problems = [m["error"] for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [
        "chart directory is missing these dependencies: kuberay-operator"]  # until `helm dependency build`

    strip_dependencies(chart)
    for values in VALUE_SETS.values():
        report = helm.lint(chart, values, strict=True, kube_version=f"v{KUBE_VERSION}")
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report

    rendered = render()
    assert sorted(rendered) == ["tandem/templates/NOTES.txt", "tandem/templates/rayservice.yaml"]
    assert "demo-tandem-serve-svc" in rendered["tandem/templates/NOTES.txt"]
    assert rayservice()["metadata"]["name"] == "demo-tandem"


def test_defaults_deploy_the_app_of_configs_serve_yaml():
    """`helm install` with no values serves what `make serve` serves, reachable from other pods."""
    ours = serve_config(rayservice())
    theirs = yaml.safe_load((ROOT / "configs" / "serve.yaml").read_text())
    app, expected = ours["applications"][0], theirs["applications"][0]
    # Helm drops null values when it merges, so `model: null` arrives as no `model` (the same default)
    assert app["args"] == {k: v for k, v in expected["args"].items() if v is not None}
    assert app["deployments"] == expected["deployments"]
    assert {k: app[k] for k in ("name", "route_prefix", "import_path", "runtime_env")} == \
           {k: expected[k] for k in ("name", "route_prefix", "import_path", "runtime_env")}
    assert ours["http_options"] == {"host": "0.0.0.0", "port": 8000}
    assert "grpc_options" not in ours  # gRPC is opt-in, as in configs/

    cluster = rayservice()["spec"]["rayClusterConfig"]
    assert [g["groupName"] for g in cluster["workerGroupSpecs"]] == ["cpu"]  # no GPU group by default
    assert cluster["rayVersion"] == "2.60.0"
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] == "ghcr.io/tandem-llm/tandem:0.1.0"  # the tag defaults to appVersion
    assert "env" not in head and "volumeMounts" not in head  # no key, no model volume unless asked


def test_overrides_reach_the_rayservice():
    rs = rayservice(OVERRIDES)
    pools = deployments(rs)
    args = serve_config(rs)["applications"][0]["args"]
    assert args["model"] == "/models/Llama-3.2-1B-Instruct" and args["kv_transfer"]["connector"] == "tcp"
    assert pools["PrefillPool"]["num_replicas"] == 2
    assert pools["PrefillPool"]["max_queued_requests"] == 1000000  # not 1e+06
    assert pools["PrefillPool"]["ray_actor_options"] == {"num_cpus": 2, "resources": {"cpu_pool": 1}}
    assert "num_replicas" not in pools["DecodePool"]  # Serve refuses both
    assert pools["DecodePool"]["autoscaling_config"] == OVERRIDES["decode"]["autoscaling_config"]
    assert pools["DecodePool"]["ray_actor_options"] == {"num_cpus": 1, "num_gpus": 1}

    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert list(groups) == ["cpu", "gpu"] and groups["gpu"]["replicas"] == 1
    assert groups["cpu"]["rayStartParams"] == {"resources": '"{\\"cpu_pool\\": 1}"'}
    gpu = groups["gpu"]["template"]["spec"]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in gpu["tolerations"]
    assert "nvidia.com/gpu" not in str(groups["cpu"]["template"])

    for where, template in pod_templates(rs).items():  # Serve may put the Router on any pod
        container = template["spec"]["containers"][0]
        assert container["image"] == "registry.example/tandem:v1", where
        assert container["env"] == [{"name": "TANDEM_API_KEY", "valueFrom": {
            "secretKeyRef": {"name": "tandem-api", "key": "token"}}}], where
        assert container["volumeMounts"] == [{"name": "model", "mountPath": "/models", "readOnly": True}]
        assert template["spec"]["volumes"] == [{"name": "model", "persistentVolumeClaim": {
            "claimName": "hf-models", "readOnly": True}}], where


def test_grpc_enabled_serves_tandems_servicer_on_the_head_port():
    rs = rayservice(OVERRIDES)
    assert serve_config(rs)["grpc_options"] == {"port": 9443, "grpc_servicer_functions": [grpc_api.SERVICER]}
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "grpc", "containerPort": 9443} in head["ports"]  # KubeRay's head Service exposes it
    assert "demo-tandem-head-svc 9443:9443" in render(OVERRIDES)["tandem/templates/NOTES.txt"]


def test_colocated_has_no_prefill_pool():
    assert list(deployments(rayservice(COLOCATED))) == ["Router", "DecodePool"]
    assert deployments(rayservice(COLOCATED))["DecodePool"]["num_replicas"] == 2


def test_host_path_model_volume_and_not_two_sources():
    rs = rayservice({"modelVolume": {"hostPath": "/mnt/models", "mountPath": "/weights"}})
    head = pod_templates(rs)["head"]["spec"]
    assert head["volumes"] == [{"name": "model", "hostPath": {"path": "/mnt/models", "type": "Directory"}}]
    assert head["containers"][0]["volumeMounts"][0]["mountPath"] == "/weights"
    with pytest.raises(helm.HelmRenderError, match="persistentVolumeClaim or hostPath, not both"):
        render({"modelVolume": {"hostPath": "/mnt/models", "persistentVolumeClaim": "hf-models"}})


def test_release_names_fit_kuberay():
    """KubeRay refuses RayService names over 47 characters (it appends suffixes for its objects);
    Helm allows 53-character release names. A release named after the chart is not doubled."""
    assert rayservice(name="a" * 53)["metadata"]["name"] == "a" * 47
    assert rayservice(name="tandem-prod")["metadata"]["name"] == "tandem-prod"


# -- values.schema.json ------------------------------------------------------------------------

@pytest.mark.parametrize("values,message", [
    ({"prefil": {"num_replicas": 2}}, "at '': additional properties 'prefil' not allowed"),
    ({"decode": {"num_replica": 2}}, "at '/decode': additional properties 'num_replica' not allowed"),
    ({"decode": {"autoscaling_config": {"min_replicas": 1, "max_replica": 4}}}, "'max_replica' not allowed"),
    ({"router": {"ray_actor_options": {"num_cpu": 1}}}, "'num_cpu' not allowed"),
    ({"args": {"modle": "/models/x"}}, "at '/args': additional properties 'modle' not allowed"),
    ({"args": {"engine": {"max_num_seq": 4}}}, "'max_num_seq' not allowed"),
    ({"args": {"kv_transfer": {"conector": "tcp"}}}, "'conector' not allowed"),
    ({"apiKey": {"secret": "tandem-api"}}, "'secret' not allowed"),
    ({"workers": {"gpu": {"gpu": 1}}}, "at '/workers/gpu': additional properties 'gpu' not allowed"),
    ({"workers": {"cpu": {"gpus": 1}}}, "at '/workers/cpu/gpus'"),  # a group with GPUs is the gpu group
    ({"head": {"resources": {"limit": {"cpu": "2"}}}}, "'limit' not allowed"),
    ({"args": {"kv_transfer": {"connector": "carrier-pigeon"}}}, "kv_transfer/connector': value must be"),
    ({"args": {"mode": "disagregated"}}, "at '/args/mode': value must be one of"),
    ({"head": {"rayStartParams": {"num-cpus": 0}}}, "num-cpus': got number, want string"),  # KubeRay's type
    ({"grpc": {"enable": True}}, "at '/grpc': additional properties 'enable' not allowed"),
    ({"args": {"speculative_config": {"method": "ngram", "num_spec_tokens": 3}}}, "'num_spec_tokens' not allowed"),
    ({"args": {"speculative_config": {"method": "medusa"}}}, "speculative_config/method': value must be"),
    ({"grpc": {"enabled": True, "port": 8000}}, "at '/grpc/port'"),  # the HTTP port
])
def test_schema_refuses_typos_by_name(values, message):
    with pytest.raises(helm.HelmValuesError, match="schema") as err:
        render(values)
    assert message in str(err.value)


# -- what the rendered objects must satisfy ----------------------------------------------------

@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_pod_templates_are_valid_kubernetes(values):
    templates = pod_templates(rayservice(values))
    assert len(templates) == (3 if values is OVERRIDES else 2)
    for group, template in templates.items():
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"demo-{group}"},
                   "template": template}
        kubernetes_validate.validate(wrapped, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_rayservice_matches_its_schema(values):
    rs = rayservice(values)
    jsonschema.validate(rs, RAYSERVICE_SCHEMA)
    cluster = rs["spec"]["rayClusterConfig"]
    cluster["workerGroupSpec"] = cluster.pop("workerGroupSpecs")  # the schema is not vacuous
    with pytest.raises(jsonschema.ValidationError, match="workerGroupSpec"):
        jsonschema.validate(rs, RAYSERVICE_SCHEMA)


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_serve_config_passes_tandems_own_validation(values):
    [app] = validate_serve_config(serve_config(rayservice(values)))
    assert app.mode == ("colocated" if values is COLOCATED else "disaggregated")
    if values is OVERRIDES:
        assert app.engine.model.model == "/models/Llama-3.2-1B-Instruct"
        assert app.kv_transfer.connector == "tcp" and app.served_model_name == "llama"
        assert (app.engine.speculative.method, app.engine.speculative.num_speculative_tokens) == ("suffix", 4)
    else:
        assert app.engine.model.model is None  # the built-in default model


# -- the kuberay-operator dependency -----------------------------------------------------------

def test_operator_dependency_is_declared_and_off_by_default(tmp_path):
    [dep] = yaml.safe_load((CHART / "Chart.yaml").read_text())["dependencies"]
    assert dep == {"name": "kuberay-operator", "version": "1.4.2",
                   "repository": "https://ray-project.github.io/kuberay-helm/",
                   "condition": "kuberay-operator.enabled"}
    with helm.Chart.load(CHART) as chart:
        assert chart.values["kuberay-operator"] == {"enabled": False}

    # a stub packaged into charts/, where `helm dependency build` leaves the real one
    chart = chart_copy(tmp_path)
    stub = tmp_path / "kuberay-operator"
    (stub / "templates").mkdir(parents=True)
    (stub / "Chart.yaml").write_text("apiVersion: v2\nname: kuberay-operator\nversion: 1.4.2\n")
    (stub / "templates" / "operator.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: stub-operator\n")
    (chart / "charts").mkdir()
    helm.package(stub, destination=chart / "charts")
    assert [d["status"] for d in helm.dependency_list(chart)] == ["ok"]
    assert not any("kuberay-operator" in path for path in render(chart=chart))
    on = render({"kuberay-operator": {"enabled": True, "image": {"tag": "v1.4.2"}}}, chart=chart)
    assert "tandem/charts/kuberay-operator/templates/operator.yaml" in on
    assert "did not install the KubeRay operator" not in on["tandem/templates/NOTES.txt"]
