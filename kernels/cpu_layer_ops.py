"""A decoder layer's element-wise steps on the CPU in C (cpu_layer_ops.c), fp32: the residual add
fused with the RMS norm after it, rotary embeddings in place, and the scatter of new K/V rows
into the paged cache (float32, or bfloat16 in a bf16 engine).

At one decode token a torch op costs 1-2 us of dispatch whatever its size, and these steps were
~30 of a layer's ops: on the 2-core EPYC, one thread, the default model's norm 7.6 us, rotary
10.3 us and K/V scatter 16.7 us a call (30 layers: ~1.3 ms of a ~14 ms bf16 decode step).

Built into the same library as the attention kernels (kernels/cpu_paged_attention.py), with the
same fallbacks: where it cannot be built the engine keeps the torch ops.
"""

from __future__ import annotations

import torch

from kernels.cpu_paged_attention import KV_DTYPES, built


def _check_f32(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")


def cpu_add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (+= delta [T, H] in place when given) → (x, rms_norm(x) * weight), as HF's
    LlamaRMSNorm in fp32. x must be contiguous and writable (a layer's running residual)."""
    _check_f32(x=x, weight=weight, **({"delta": delta} if delta is not None else {}))
    rows, hidden = x.shape
    if not x.is_contiguous() or weight.shape != (hidden,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"x {tuple(x.shape)} must be contiguous, weight [{hidden}] and delta of x's shape")
    if delta is not None and not delta.is_contiguous():
        delta = delta.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty_like(x)
    built().tandem_add_rms_norm_f32(x.data_ptr(), delta.data_ptr() if delta is not None else None, w.data_ptr(),
                                   out.data_ptr(), rows, hidden, eps)
    return x, out


def cpu_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x [T, heads, D] in place (heads contiguous in a token's
    row, tokens any stride apart: a view into a fused qkv output); cos, sin [T, D/2] (or the
    [T, 1, D/2] RotaryEmbedding.lookup gives). Returns x."""
    _check_f32(x=x, cos=cos, sin=sin)
    tokens, heads, dim = x.shape
    cos, sin = cos.reshape(tokens, -1), sin.reshape(tokens, -1)
    if dim % 2 or cos.shape != (tokens, dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"x {tuple(x.shape)} does not fit cos/sin {tuple(cos.shape)}")
    if x.stride(2) != 1 or x.stride(1) != dim:
        raise ValueError(f"x's heads must be contiguous within a token (strides {x.stride()})")
    cos, sin = cos.contiguous(), sin.contiguous()
    built().tandem_rope_f32(x.data_ptr(), tokens, heads, x.stride(0), dim, cos.data_ptr(), sin.data_ptr())
    return x


def cpu_store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """ref_store_kv's contract (kernels/reference.py): key/value [T, Hkv, D] into slots [T] of the
    caches [num_blocks, block_size, Hkv, D]; slots < 0 are skipped. key/value float32, a token's
    heads contiguous (views into a fused qkv output are fine); caches float32, or bfloat16
    (rounded to nearest even, as `.to(torch.bfloat16)`); slots past the cache are refused."""
    _check_f32(key=key, value=value)
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype or k_cache.device.type != "cpu":
        raise TypeError(f"caches must be float32 or bfloat16 CPU tensors, got {k_cache.dtype} / {v_cache.dtype}")
    tokens, num_kv_heads, head_dim = key.shape
    if (value.shape != key.shape or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim)
            or slot_mapping.shape != (tokens,)):
        raise ValueError(f"key {tuple(key.shape)} / value {tuple(value.shape)} / slots {tuple(slot_mapping.shape)} "
                         f"do not fit caches {tuple(k_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    key, value = (t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous() for t in (key, value))
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    slots = slots.contiguous()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    lib = built()
    store = lib.tandem_store_kv_f32 if k_cache.dtype == torch.float32 else lib.tandem_store_kv_bf16kv
    bad = store(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), tokens, num_kv_heads * head_dim, num_slots)
    if bad:
        raise ValueError(f"{bad} slot(s) past the cache's {num_slots}")
