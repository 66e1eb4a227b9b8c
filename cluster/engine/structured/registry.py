"""Structured-output backends by name (engine/structured/base.py states the contract)."""

from __future__ import annotations

from typing import Any

from cluster.engine.structured.base import StructuredBackend


def create_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> StructuredBackend:
    if name != "xgrammar":
        raise ValueError(f"unknown structured-output backend {name!r} (xgrammar is the one there is)")
    from cluster.engine.structured.xgrammar_backend import XGrammarBackend  # imports torch

    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
