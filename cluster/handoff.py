"""The prefill → decode hand-off's failures, as both sides and the router name them. Torch-free:
the router maps them to HTTP / gRPC errors (router/edges.py) without loading the engine."""

from __future__ import annotations


class PrefillReplicaLost(RuntimeError):
    """The prefill replica died before answering (a `PrefillClient` raises it): worth a retry."""


class PrefillFailed(RuntimeError):
    """The prefill pool could not produce R's first token and the policy is `fail`."""
