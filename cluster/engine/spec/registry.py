"""Proposers by name (SpeculativeConfig.method). The registry imports the proposers; none of
them imports it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.config import SpeculativeConfig
from cluster.engine.spec.base import Proposer
from cluster.engine.spec.ngram import NgramProposer
from cluster.engine.spec.suffix import SuffixProposer

if TYPE_CHECKING:
    from cluster.engine.engine import LLMEngine


def create_proposer(config: SpeculativeConfig, target: LLMEngine) -> Proposer:
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    from cluster.engine.spec.draft_model import DraftModelProposer  # loads torch weights

    return DraftModelProposer(config, target)
