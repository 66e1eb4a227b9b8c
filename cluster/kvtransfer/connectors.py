"""The connector registry: the built-in connectors by name. It imports them; none of them
imports it (cluster/kvtransfer/base.py is the contract they implement)."""

from __future__ import annotations

from typing import Any

from cluster.kvtransfer.base import KVConnector
from cluster.kvtransfer.collective import CollectiveConnector
from cluster.kvtransfer.shared_store import SharedStoreConnector
from cluster.kvtransfer.tcp import TcpConnector
from cluster.engine.kv_layout import KVLayout

CONNECTORS: dict[str, type[KVConnector]] = {c.name: c for c in (SharedStoreConnector, TcpConnector, CollectiveConnector)}


def create_connector(name: str, layout: KVLayout, **options: Any) -> KVConnector:
    """Build a connector by name (`shared_store`, `tcp`, `collective`)."""
    if name not in CONNECTORS:
        raise ValueError(f"unknown KV connector {name!r}; available: {sorted(CONNECTORS)}")
    return CONNECTORS[name](layout, **options)
