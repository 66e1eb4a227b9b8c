"""Scatter one step's new K/V rows into the paged cache by slot number."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (FLOAT_DTYPES, check_contiguous, check_devices, check_dtype,
                             check_ndim, check_same)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    # the padding test is made on a vector: the interpreter mis-types `block & scalar` masks
    keep = (h + slot) >= h
    mask = keep[:, None] & (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)

    key = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    # cache row of a slot: [Hkv, D] contiguous at slot * Hkv * D
    dst = (slot * NUM_KV_HEADS + h[:, None]) * HEAD_DIM + d[None, :]
    tl.store(k_cache_ptr + dst, key, mask=mask)
    tl.store(v_cache_ptr + dst, value, mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value rows into the paged cache, in place.

    key, value:       [T, Hkv, D], last dim contiguous, same dtype as the caches
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], contiguous
    slot_mapping:     [T] int32/int64, slot = block_id * block_size + offset; < 0 means skip
    """
    check_devices(key=key, value=value, k_cache=k_cache, v_cache=v_cache,
                  slot_mapping=slot_mapping)
    check_ndim("key", key, 3, "[T, Hkv, D]")
    check_ndim("k_cache", k_cache, 4, "[num_blocks, block_size, Hkv, D]")
    check_same("value", value, "key", key)
    check_same("v_cache", v_cache, "k_cache", k_cache)
    check_dtype("k_cache", k_cache, FLOAT_DTYPES)
    if key.dtype != k_cache.dtype:
        raise TypeError(f"key has dtype {key.dtype} but k_cache has {k_cache.dtype}")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key heads/dim {tuple(key.shape[1:])} do not match "
                         f"k_cache {tuple(k_cache.shape[2:])}")
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    for name, t in (("key", key), ("value", value)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} must have a contiguous last dim (strides {t.stride()})")
    check_dtype("slot_mapping", slot_mapping, (torch.int32, torch.int64))
    if slot_mapping.shape != key.shape[:1]:
        raise ValueError(f"slot_mapping must be [T]={tuple(key.shape[:1])}, "
                         f"got {tuple(slot_mapping.shape)}")
    slot_mapping = slot_mapping.contiguous()

    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads), DIM_PAD=triton.next_power_of_2(head_dim),
    )
