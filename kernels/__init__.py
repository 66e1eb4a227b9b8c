"""KV-cache kernels: Triton launchers for CUDA; C attention kernels (paged decode, causal
prefill), a layer's element-wise steps in C, and pure-torch references for CPU.

`ops_for(device, dtype)` picks the set the engine should call; every set shares signatures.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from kernels import cpu_paged_attention
from kernels.cpu_layer_ops import cpu_add_rms_norm, cpu_decode_attention, cpu_rope_, cpu_silu_mul, cpu_store_kv
from kernels.cpu_paged_attention import amx_prefill_attention, cpu_paged_decode_attention, cpu_prefill_attention
from kernels.pack_kv import pack_kv, unpack_kv
from kernels.paged_attention import paged_decode_attention
from kernels.reference import (ref_pack_kv, ref_paged_decode_attention, ref_store_kv, ref_unpack_kv,
                               sdpa_causal_attention)
from kernels.store_kv import store_kv

__all__ = [
    "KernelOps", "ops_for",
    "store_kv", "paged_decode_attention", "pack_kv", "unpack_kv",
    "cpu_paged_decode_attention", "cpu_prefill_attention", "amx_prefill_attention", "cpu_add_rms_norm", "cpu_rope_", "cpu_silu_mul",
    "cpu_store_kv", "cpu_decode_attention",
    "ref_store_kv", "ref_paged_decode_attention", "ref_pack_kv", "ref_unpack_kv", "sdpa_causal_attention",
]


class KernelOps(NamedTuple):
    store_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    pack_kv: Callable[..., torch.Tensor]
    unpack_kv: Callable[..., None]
    # False: `paged_decode_attention` is only a reference, and the CPU engine gathers each
    # decode's K/V rows with its own index (cluster/models/attention.py) rather than call it.
    decode_in_place: bool = True
    # causal attention of a prefill chunk over contiguous K/V ([n, Hq, D] queries, [ctx, Hkv, D]),
    # (q, k, v, scale, products dtype: bfloat16 where K/V are bf16 values); None: torch's SDPA
    # (cluster/models/attention.py)
    prefill_attention: Callable[..., torch.Tensor] | None = None
    # the residual add and the RMS norm after it in one call, (x, delta | None, weight, eps,
    # out_dtype) → (x += delta, norm(x) in out_dtype); delta float32 or bfloat16 (a bf16
    # projection's output); None: torch's ops (cluster/models/llama.py)
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    # silu(gate) * up of a bfloat16 [T, 2I] gate/up output → bfloat16 [T, I]; None: torch's ops
    silu_mul: Callable[[torch.Tensor], torch.Tensor] | None = None
    # a decode-only step's attention in one call, from the qkv output to the o input: (qkv, cos,
    # sin, k_cache, v_cache, slot_mapping, block_tables, context_lens, num_heads, scale) →
    # [B, Hq * D] in qkv's dtype; None: rope_, store_kv and paged_decode_attention one by one
    decode_attention: Callable[..., torch.Tensor] | None = None
    # rotary embedding in place, (x [T, heads, D], cos, sin) → x; None: RotaryEmbedding.apply's copy
    rope_: Callable[..., torch.Tensor] | None = None
    # store_kv and paged_decode_attention also take bfloat16 caches beside float32 activations
    # (a CPU engine in bf16 keeps its K/V in bf16: half the bytes decode attention reads)
    bf16_kv: bool = False
    # float32 weights that are exactly 4/8-bit blocks (a checkpoint converted from a quantized
    # GGUF) also kept as those blocks, for decode steps' few-row products (kernels/block_weights.py)
    block_weights: bool = False


TRITON_OPS = KernelOps(store_kv, paged_decode_attention, pack_kv, unpack_kv)
REFERENCE_OPS = KernelOps(ref_store_kv, ref_paged_decode_attention, ref_pack_kv, ref_unpack_kv, False)
CPU_OPS = REFERENCE_OPS._replace(store_kv=cpu_store_kv, paged_decode_attention=cpu_paged_decode_attention,
                                 decode_in_place=True, prefill_attention=cpu_prefill_attention,
                                 add_rms_norm=cpu_add_rms_norm, rope_=cpu_rope_, bf16_kv=True,
                                 silu_mul=cpu_silu_mul, decode_attention=cpu_decode_attention,
                                 block_weights=True)


# a CPU with AMX: a bf16 engine's prefill attention through torch's fused SDPA, whose bf16 products
# run as tile instructions there (amx_prefill_attention: ~3.6x the C kernel at 1,024 tokens)
AMX_CPU_OPS = CPU_OPS._replace(prefill_attention=cpu_paged_attention.amx_prefill_attention)
# a CPU without AVX-512: the C decode kernels (109 against 127 ms a token on the 2-core AVX2 EPYC),
# prefill attention in torch's fused SDPA (the engine's own path, cluster/models/attention.py):
# the C prefill kernel's 512-bit tiles spill there, ~10x slower (cpu_paged_attention.avx512)
AVX2_CPU_OPS = CPU_OPS._replace(prefill_attention=None)


def ops_for(device: torch.device, dtype: torch.dtype = torch.float32) -> KernelOps:
    """Triton launchers on CUDA devices; on the CPU in float32, the C attention kernels where this
    machine can build them (kernels/cpu_paged_attention.py), with a bf16 engine's prefill
    attention in torch's fused SDPA where the CPU has AMX, and every prefill's where it has no
    AVX-512; the torch references otherwise."""
    if device.type == "cuda":
        return TRITON_OPS
    if dtype == torch.float32 and cpu_paged_attention.available():
        if cpu_paged_attention.amx_bf16():
            return AMX_CPU_OPS
        return CPU_OPS if cpu_paged_attention.avx512() else AVX2_CPU_OPS
    return REFERENCE_OPS
