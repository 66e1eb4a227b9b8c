"""Validation of Serve YAML at the edge: Ray's own schema, plus what it lets through.

    validate_serve_config(path or dict)
      1. ServeDeploySchema (Ray's schema for `serve deploy` files)
      2. strict keys: every key at every level must be a field Ray knows (Ray silently drops
         unknown ones, so `num_replica: 2` would deploy one replica without a word); gRPC
         servicer functions must import; a custom autoscaling policy class must take its
         policy_kwargs (Ray's schema imports the policy, but only its controller builds it, later)
      3. Tandem apps (import_path cluster.router.app:build_app): `args` through
         AppConfig.from_args (unknown keys named), deployments named Router / PrefillPool /
         DecodePool only (no PrefillPool in colocated mode). Prefill and decode are built
         from the one `args`, so they always agree on the model and the KV layout.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from cluster.app_config import AppConfig

TANDEM_IMPORT_PATH = "cluster.router.app:build_app"
POOLS = {"disaggregated": {"Router", "PrefillPool", "DecodePool"}, "colocated": {"Router", "DecodePool"}}


class ConfigError(ValueError):
    pass


def load_yaml(path: str | Path) -> dict[str, Any]:
    data = yaml.safe_load(Path(path).read_text())
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    return data


def validate_serve_config(config: str | Path | dict[str, Any]) -> list[AppConfig]:
    """Raise ConfigError naming the first problem; return the Tandem apps' configs."""
    from ray.serve.schema import ServeDeploySchema

    raw = load_yaml(config) if not isinstance(config, dict) else config
    try:
        ServeDeploySchema.model_validate(raw)
    except Exception as exc:
        raise ConfigError(f"not a valid Serve config: {exc}") from None
    check_keys(ServeDeploySchema, raw, "")
    check_grpc_servicers(raw.get("grpc_options") or {})
    apps = []
    for i, app in enumerate(raw.get("applications") or []):
        check_autoscaling_policies(app, f"applications[{i}]")
        if app.get("import_path") != TANDEM_IMPORT_PATH:
            continue
        where = f"applications[{i}]"
        try:
            cfg = AppConfig.from_args(app.get("args"))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{where}.args: {exc}") from None
        allowed = POOLS[cfg.mode]
        for d in app.get("deployments") or []:
            if d.get("name") not in allowed:
                raise ConfigError(f"{where}.deployments: {d.get('name')!r} is not a deployment of a "
                                  f"{cfg.mode} Tandem app; expected one of {sorted(allowed)}")
        apps.append(cfg)
    return apps


def check_grpc_servicers(grpc_options: dict[str, Any]) -> None:
    """Each of grpc_options.grpc_servicer_functions imports (Serve's proxy fails to start otherwise)."""
    import importlib

    for path in grpc_options.get("grpc_servicer_functions") or []:
        module, _, name = str(path).rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), name) if module else None
        except (ImportError, AttributeError):
            fn = None
        if not callable(fn):
            raise ConfigError(f"grpc_options.grpc_servicer_functions: {path!r} cannot be imported "
                              f"(Tandem's is cluster.router.grpc_servicer.add_tandem_servicer)")


def check_autoscaling_policies(app: dict[str, Any], where: str) -> None:
    """Each deployment's `autoscaling_config.policy`, when a class, takes its policy_kwargs."""
    import inspect

    from ray._common.utils import import_module_and_attr  # how Serve's controller resolves it

    for d in app.get("deployments") or []:
        policy = (d.get("autoscaling_config") or {}).get("policy") or {}
        path = policy.get("policy_function")
        if not isinstance(path, str):
            continue
        at = f"{where}.deployments[{d.get('name')!r}].autoscaling_config.policy"
        _, fn = import_module_and_attr(path)  # ServeDeploySchema has imported it already
        if inspect.isclass(fn):
            try:
                fn(**(policy.get("policy_kwargs") or {}))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{at}.policy_kwargs: {exc}") from None


def check_keys(model: type[BaseModel], data: Any, where: str) -> None:
    """Every key of `data` must be a field (or alias) of `model`, recursively into sub-models."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    names = {name: f for name, f in fields.items()}
    names.update({f.alias: f for f in fields.values() if f.alias})
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown key {where + '.' if where else ''}{key!r} "
                              f"(known here: {', '.join(sorted(fields))})")
        for sub in _models_in(names[key].annotation):
            path = f"{where}.{key}" if where else key
            if isinstance(value, list):
                for j, item in enumerate(value):
                    check_keys(sub, item, f"{path}[{j}]")
            else:
                check_keys(sub, value, path)


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def apply_serve_config(config: dict[str, Any]) -> None:
    """`serve deploy` from inside a driver that already runs Serve (tests, benches): validate the
    config as above, then hand the Serve controller every application in it, deployment options
    from YAML included. Returns at once; the controller converges in the background. The file's
    http_options / proxy_location are left out: the running Serve keeps its own."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    validate_serve_config(config)
    apps = {"applications": config["applications"]}
    _get_global_client().deploy_apps(ServeDeploySchema.model_validate(apps))
