"""Llama-family forward pass over the paged KV cache (Llama, SmolLM, Mistral, Qwen2).

Weights are plain tensors with q/k/v and gate/up fused, so a layer is four matmuls; each
projection is a `Linear` (cluster/models/linear.py: oneDNN-prepacked on CPU fp32).

A CPU engine in bf16 keeps the residual stream in fp32 and feeds its projections bf16: the fused
norms write bf16, a projection's bf16 output goes on as it is (into the residual add, into
silu * up), and only q/k/v return to fp32, for rotary and attention. On the 2-core EPYC, one
thread, against casting around each projection (2026-11-27, runs alternated on a noisy host; the
bf16 prefill attention of kernels/cpu_paged_attention.py included): a 1,024-token prefill
~1.8 -> ~1.55 s, a single-stream decode step 27-33 -> 24-26 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.models.architecture import Architecture
from cluster.models.attention import AttentionMetadata, paged_attention
from cluster.models.linear import Linear, RefinedHead
from cluster.models.rope import RotaryEmbedding
from kernels import KernelOps


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # H → q + 2*kv (with the q/k/v biases when the model has them)
    o: Linear  # q → H
    post_norm: torch.Tensor  # [H]
    gate_up: Linear  # H → 2*I
    down: Linear  # I → H


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [V, H]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [H]
    lm_head: Linear | RefinedHead  # H → V


class LlamaModel:
    def __init__(self, arch: Architecture, weights: ModelWeights, ops: KernelOps, max_positions: int) -> None:
        self.arch = arch
        self.w = weights
        self.ops = ops
        self.scale = arch.head_dim ** -0.5
        self.rope = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta, arch.rope,
                                    weights.embed.device, weights.embed.dtype)
        # what the projections multiply in: the activations' dtype, or bf16 beside float32
        # activations (a CPU engine in bf16, cluster/engine/model_runner.py)
        self.proj_dtype = weights.layers[0].gate_up.dtype if weights.layers else weights.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.w.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.w.embed.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [T]; kv_cache [L, 2, NB, BS, Hkv, D] → hidden [T, H] (pre-norm)."""
        x = self.w.embed.index_select(0, input_ids)  # [T, H]
        rope = self.rope.lookup(positions)
        eps, add_norm = self.arch.rms_norm_eps, self.ops.add_rms_norm
        if add_norm is not None:  # CPU: each residual add fused with the norm after it, x updated in place;
            delta, proj = None, self.proj_dtype  # the norms come out in the projections' dtype and
            for layer, kv_layer in zip(self.w.layers, kv_cache):  # their outputs go back in as they are
                x, h = add_norm(x, delta, layer.input_norm, eps, proj)
                x, h = add_norm(x, self._attention(layer, h, rope, kv_layer, meta), layer.post_norm, eps, proj)
                delta = self._mlp(layer, h)
            return x if delta is None else x + delta
        for layer, kv_layer in zip(self.w.layers, kv_cache):
            x = x + self._attention(layer, F.rms_norm(x, x.shape[-1:], layer.input_norm, eps), rope, kv_layer, meta)
            x = x + self._mlp(layer, F.rms_norm(x, x.shape[-1:], layer.post_norm, eps))
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, H] of the positions to sample → float32 logits [S, V]."""
        h = F.rms_norm(hidden, hidden.shape[-1:], self.w.norm, self.arch.rms_norm_eps)
        return self.w.lm_head.float_out(h)

    def _attention(self, layer: LayerWeights, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   kv_layer: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        a = self.arch
        qkv = layer.qkv(x)
        if (self.ops.decode_attention is not None and meta.num_decode_tokens == qkv.shape[0] and not meta.prefills
                and not meta.cpu_verify and meta.cpu_decode is None):  # a decode-only step on the CPU: one call
            return layer.o(self.ops.decode_attention(qkv, *rope, kv_layer[0], kv_layer[1], meta.slot_mapping,
                                                     meta.decode_block_tables, meta.decode_context_lens,
                                                     a.num_heads, self.scale))
        qkv = qkv.to(self.dtype).view(-1, a.num_heads + 2 * a.num_kv_heads, a.head_dim)
        qk = qkv[:, : a.num_heads + a.num_kv_heads]  # rotated in place where the ops can (qkv is fresh)
        qk = self.ops.rope_(qk, *rope) if self.ops.rope_ is not None else self.rope.apply(qk, *rope)
        q, k = qk[:, : a.num_heads], qk[:, a.num_heads:]
        v = qkv[:, a.num_heads + a.num_kv_heads:]
        out = paged_attention(q, k, v, kv_layer, meta, self.ops, self.scale)  # [T, Hq, D]
        return layer.o(out.reshape(-1, a.q_size).to(x.dtype))  # in x's dtype, as every projection here

    def _mlp(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate_up = layer.gate_up(x)
        if gate_up.dtype == torch.bfloat16 and self.ops.silu_mul is not None:  # CPU: one pass in C
            return layer.down(self.ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)
