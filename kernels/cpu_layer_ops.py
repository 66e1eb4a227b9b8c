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
