"""Tandem: disaggregated prefill/decode LLM serving on Ray.

`from cluster import LLM, SamplingParams, StructuredOutput` is the offline API. Imports are lazy so that
light modules (the router, configs) never pull in torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutput", "EngineConfig"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from cluster.llm import LLM

        return LLM
    if name == "SamplingParams":
        from cluster.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutput":
        from cluster.structured_output import StructuredOutput

        return StructuredOutput
    if name == "EngineConfig":
        from cluster.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
