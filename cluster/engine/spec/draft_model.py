"""Draft-model proposing: a small model of the target's tokenizer drafts greedily, k passes of
one token per request, over a paged KV cache of its own.

The draft's cache mirrors the target's block for block: it has as many blocks, and a request's
blocks hold its draft KV under the same block ids, so the target's block tables, prefix cache
and hand-offs serve both. Whatever the target computes in a step, the draft computes too
(`computed`: prefill chunks, decode tokens, verified drafts), so the draft's KV is valid wherever
the target's is: after a preemption, a prefix-cache hit, a local prefill. KV that arrives from a
prefill replica carries the draft's part beside the target's (engine.export_kv / import_kv;
`pack` / `unpack` below), so a decode replica never runs the draft over a prompt it did not
prefill (vLLM #54926).

Drafts are greedy (the draft's argmax): a point mass, which the verifier's rejection sampling
keeps exact for sampled requests too (engine/sampler.py: `_choose_verifying`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Sequence

import torch

from cluster.config import SpeculativeConfig
from cluster.engine.model_runner import ModelRunner
from cluster.engine.sampler import greedy
from cluster.engine.step_plan import ScheduledChunk
from cluster.engine.spec.base import Proposer
from cluster.engine.tokenizer import Tokenizer
from cluster.models.architecture import Architecture
from cluster.models.default_model import resolve_model_path
from cluster.engine.request import Request

if TYPE_CHECKING:
    from cluster.engine.engine import LLMEngine


class DraftModelProposer(Proposer):
    name = "draft_model"
    cheap = False
    has_kv = True

    def __init__(self, config: SpeculativeConfig, target: LLMEngine) -> None:
        self.model_path = resolve_model_path(config.model)
        if not (self.model_path / "config.json").is_file():
            raise ValueError(f"draft model {config.model!r}: no config.json there (a local HF folder is needed)")
        self.arch = Architecture.from_folder(self.model_path)
        draft_vocab = Tokenizer(self.model_path).hf.get_vocab()
        if draft_vocab != target.tokenizer.hf.get_vocab():
            raise ValueError(f"draft model {config.model!r} has a tokenizer other than the target's "
                             f"({len(draft_vocab)} vs {target.arch.vocab_size} entries, or the same size with "
                             "other tokens): its drafts would be other tokens' ids")
        if self.arch.vocab_size < target.arch.vocab_size:
            raise ValueError(f"draft model {config.model!r}: vocabulary {self.arch.vocab_size} is smaller than "
                             f"the target's {target.arch.vocab_size}")
        cache = dataclasses.replace(target.config.cache, num_blocks=target.num_blocks)
        model = dataclasses.replace(target.config.model, model=str(self.model_path), enforce_eager=True)
        self.runner = ModelRunner(str(self.model_path), self.arch, model, cache, target.max_model_len,
                                  target.config.seed)

    def propose(self, requests: Sequence[Request], limits: Sequence[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active = [i for i, k in enumerate(limits) if k > 0]
        while active:
            chunks = []
            for i in active:
                req, made = requests[i], drafts[i]
                last = req.num_tokens - 1 + len(made)  # the position of the token fed this pass
                chunks.append(ScheduledChunk(req, last, 1, (made[-1],)) if made else ScheduledChunk(req, last, 1))
            logits = self.runner.compute(chunks)
            assert logits is not None
            for i, token in zip(active, greedy(logits).tolist()):
                drafts[i].append(token)
            active = [i for i in active if len(drafts[i]) < limits[i]]
        return drafts

    def computed(self, chunks: Sequence[ScheduledChunk]) -> None:
        self.runner.compute(list(chunks), logits=False)

    # -- the draft's part of a hand-off's KV ------------------------------------------------
    def layers_like(self, target_row: tuple[int, ...]) -> int:
        """How many target-shaped layers (K and V of [block_size, Hkv, D] each) the draft's KV of
        one block fills when packed beside the target's."""
        per_layer = math.prod(target_row) * 2
        return -(-self.arch.num_layers * 2 * math.prod(self.runner.kv_cache.shape[3:]) // per_layer)

    @torch.inference_mode()
    def pack(self, block_ids: list[int], like: torch.Tensor) -> torch.Tensor:
        """The draft KV of `block_ids` reshaped as extra layers of the target's packed payload
        `like` [L, 2, n, BS, Hkv, D] (zero-padded): [L', 2, n, BS, Hkv, D]."""
        own = self.runner.export_kv(block_ids)  # [Ld, 2, n, BSd, Hd, Dd]
        n = len(block_ids)
        flat = own.permute(2, 0, 1, 3, 4, 5).reshape(n, -1)  # [n, per block]
        extra = self.layers_like(tuple(like.shape[3:]))
        width = extra * 2 * math.prod(like.shape[3:])
        flat = torch.nn.functional.pad(flat, (0, width - flat.shape[1]))
        return flat.view(n, extra, 2, *like.shape[3:]).permute(1, 2, 0, 3, 4, 5).contiguous()

    @torch.inference_mode()
    def unpack(self, block_ids: list[int], packed: torch.Tensor) -> None:
        """The inverse of `pack`: write the draft's part of a payload into its cache."""
        n = len(block_ids)
        shape = self.runner.kv_cache.shape
        own = (self.arch.num_layers, 2, shape[3], shape[4], shape[5])
        flat = packed.permute(2, 0, 1, 3, 4, 5).reshape(n, -1)[:, :math.prod(own)]
        self.runner.import_kv(block_ids, flat.reshape(n, *own).permute(1, 2, 0, 3, 4, 5).contiguous())
