"""Imports the built-in connectors so they register by name."""

from cluster.kvtransfer import collective, shared_store, tcp  # noqa: F401
