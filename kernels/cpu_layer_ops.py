"""A decoder layer's element-wise steps on the CPU in C (cpu_layer_ops.c), fp32 arithmetic: the
residual add fused with the RMS norm after it, rotary embeddings in place, the scatter of new K/V
rows into the paged cache (float32, or bfloat16 in a bf16 engine), and the MLP's silu(gate) * up
between two bf16 projections.

At one decode token a torch op costs 1-2 us of dispatch whatever its size, and these steps were
~30 of a layer's ops: on the 2-core EPYC, one thread, the default model's norm 7.6 us, rotary
10.3 us and K/V scatter 16.7 us a call (30 layers: ~1.3 ms of a ~14 ms bf16 decode step).

silu * up on a bf16 engine's gate/up output replaces four passes over a layer's widest
activations (cast to fp32, silu, multiply, cast to bf16): profiled at 1,024 prompt tokens, one
thread, those four were ~24% of the prefill; the fused call is ~3%.

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


def cpu_add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (+= delta [T, H] in place when given) → (x, rms_norm(x) * weight), as HF's
    LlamaRMSNorm in fp32. x must be contiguous and writable (a layer's running residual), float32;
    delta float32 or bfloat16 (a bf16 projection's output); the norm comes out in `out_dtype`
    (bfloat16: rounded as `.to(torch.bfloat16)`, the input of a bf16 projection)."""
    _check_f32(x=x, weight=weight)
    rows, hidden = x.shape
    if not x.is_contiguous() or weight.shape != (hidden,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"x {tuple(x.shape)} must be contiguous, weight [{hidden}] and delta of x's shape")
    if out_dtype not in KV_DTYPES or (delta is not None and (delta.dtype not in KV_DTYPES or delta.device != x.device)):
        raise TypeError(f"delta and out_dtype must be float32 or bfloat16 on the CPU, got "
                        f"{None if delta is None else delta.dtype} / {out_dtype}")
    if delta is not None and not delta.is_contiguous():
        delta = delta.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    out = torch.empty(x.shape, dtype=out_dtype)
    built().tandem_add_rms_norm(x.data_ptr(), delta.data_ptr() if delta is not None else None, w.data_ptr(),
                                out.data_ptr(), rows, hidden, eps,
                                delta is not None and delta.dtype == torch.bfloat16, out_dtype == torch.bfloat16)
    return x, out


def cpu_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up bfloat16 [T, 2I] (a fused gate/up projection's output) → bfloat16 [T, I]:
    silu(gate) * up computed in fp32 and rounded once, as `(F.silu(gate.float()) * up.float())
    .to(torch.bfloat16)`, in one pass instead of four over the widest activations of a layer."""
    if gate_up.dtype != torch.bfloat16 or gate_up.device.type != "cpu" or gate_up.dim() != 2:
        raise TypeError(f"gate_up must be a 2-D bfloat16 CPU tensor, got {gate_up.dtype} {tuple(gate_up.shape)} "
                        f"on {gate_up.device}")
    rows, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} must have an even width and contiguous rows")
    out = torch.empty(rows, width // 2, dtype=torch.bfloat16)
    built().tandem_silu_mul_bf16(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, width // 2)
    return out


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


def cpu_decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
    """A decode-only step's attention, from the qkv projection's output qkv [B, (Hq + 2 Hkv) * D]
    (float32 or bfloat16) to the o projection's input [B, Hq * D] in qkv's dtype: `cpu_rope_` on
    q and k (cos/sin of each row's position, [B, D/2] or [B, 1, D/2]), `cpu_store_kv` of k and v
    at slot_mapping [B], and `cpu_paged_decode_attention` over each row's context (block_tables
    [B, W] and context_lens [B], int32) in one call. Caches float32 or bfloat16, contiguous.

    A layer's attention was ~10 torch ops and three of these calls, and at one decode token their
    Python costs more than their arithmetic: on the 2-core EPYC, one thread, the default model in
    bf16, a whole decode step with and without it, interleaved in one process (medians of 8 runs
    of 25 steps, 2026-11-27): one stream 28.4 -> 26.0 ms, eight 40.2 -> 35.5."""
    if qkv.dtype not in KV_DTYPES or qkv.device.type != "cpu" or qkv.dim() != 2 or qkv.stride(1) != 1:
        raise TypeError(f"qkv must be a 2-D float32 or bfloat16 CPU tensor with contiguous rows, got {qkv.dtype} "
                        f"{tuple(qkv.shape)} on {qkv.device}")
    if (k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype or k_cache.device.type != "cpu"
            or v_cache.device.type != "cpu"):
        raise TypeError(f"caches must be float32 or bfloat16 CPU tensors, got {k_cache.dtype} / {v_cache.dtype}")
    batch, width = qkv.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if (not (k_cache.is_contiguous() and v_cache.is_contiguous()) or v_cache.shape != k_cache.shape
            or num_heads % num_kv_heads or width != (num_heads + 2 * num_kv_heads) * head_dim):
        raise ValueError(f"qkv {tuple(qkv.shape)} with {num_heads} query heads does not fit contiguous caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    _check_f32(cos=cos, sin=sin)
    cos, sin = cos.reshape(batch, -1).contiguous(), sin.reshape(batch, -1).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    tables, lens = block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
    if (cos.shape != (batch, head_dim // 2) or sin.shape != cos.shape or slots.shape != (batch,)
            or tables.ndim != 2 or tables.shape[0] != batch or lens.shape != (batch,)):
        raise ValueError(f"cos {tuple(cos.shape)}, slots {tuple(slots.shape)}, block_tables {tuple(tables.shape)} "
                         f"and context_lens {tuple(lens.shape)} must have a row per qkv row ({batch})")
    out = torch.empty(batch, num_heads * head_dim, dtype=qkv.dtype)
    if batch == 0:
        return out
    capacity = tables.shape[1] * block_size
    work = torch.empty(batch * (2 * num_heads + 2 * num_kv_heads) * head_dim + num_heads * capacity,
                       dtype=torch.float32)
    bf16 = torch.bfloat16
    bad = built().tandem_decode_attention(
        qkv.data_ptr(), qkv.stride(0), qkv.dtype == bf16, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), k_cache.dtype == bf16, k_cache.shape[0] * block_size, slots.data_ptr(), tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), batch, num_heads, num_kv_heads, head_dim, block_size, scale,
        work.data_ptr(), out.data_ptr(), qkv.dtype == bf16)
    if bad == -1:
        raise ValueError(f"slot_mapping has slots past the cache's {k_cache.shape[0] * block_size}")
    if bad:
        raise ValueError(f"context_lens must be in [1, {capacity}]")
    return out
