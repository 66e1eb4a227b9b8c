"""Paged decode attention: one query token per sequence over its blocks of cached K/V.

One program per (sequence, kv head) handles the G = Hq // Hkv query heads that share the
kv head, walking the sequence's block table with an online softmax:

    block_tables[b] = [ 7, 2, 9, x ]       context_len 21, block_size 8
    logical block j:    0  1  2            positions j*8 .. j*8+7, masked at >= 21
    token row of (block 9, offset 4):  k_cache[(9 * 8 + 4) * Hkv + kv_head] -> [D]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (FLOAT_DTYPES, check_contiguous, check_devices, check_dtype,
                             check_ndim, check_same)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr, lens_ptr, scale,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_tb, stride_tj,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    t = tl.arange(0, BLOCK_PAD)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)

    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0).to(tl.float32) * scale  # [G, D]
    context_len = tl.load(lens_ptr + seq)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for j in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block_id = tl.load(tables_ptr + seq * stride_tb + j * stride_tj).to(tl.int64)
        t_mask = (t < BLOCK_SIZE) & (j * BLOCK_SIZE + t < context_len)
        kv_mask = t_mask[:, None] & (d[None, :] < HEAD_DIM)
        rows = (block_id * BLOCK_SIZE + t) * NUM_KV_HEADS + kv_head  # [T]
        offs = rows[:, None] * HEAD_DIM + d[None, :]  # [T, D]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)

        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, T]
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])  # [G, T]
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new

    out = acc / denom[:, None]
    tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """Attention of one new token per sequence over its paged K/V (already stored).

    query:            [B, Hq, D], last dim contiguous; Hq % Hkv == 0
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], contiguous, query's dtype
    block_tables:     [B, max_blocks] int32; entries past a sequence's last block are ignored
    context_lens:     [B] int32, tokens to attend to (>= 1, including the new one)
    Returns [B, Hq, D] in query's dtype. Query head h uses kv head h // (Hq // Hkv).
    """
    check_devices(query=query, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                  context_lens=context_lens)
    check_ndim("query", query, 3, "[B, Hq, D]")
    check_ndim("k_cache", k_cache, 4, "[num_blocks, block_size, Hkv, D]")
    check_ndim("block_tables", block_tables, 2, "[B, max_blocks]")
    check_same("v_cache", v_cache, "k_cache", k_cache)
    check_dtype("query", query, FLOAT_DTYPES)
    if k_cache.dtype != query.dtype:
        raise TypeError(f"k_cache has dtype {k_cache.dtype} but query has {query.dtype}")
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_dtype("context_lens", context_lens, (torch.int32,))
    check_contiguous("k_cache", k_cache)
    check_contiguous("v_cache", v_cache)
    if query.stride(2) != 1:
        raise ValueError(f"query must have a contiguous last dim (strides {query.stride()})")

    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if cache_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != k_cache head_dim {cache_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads {num_heads} is not a multiple of k_cache heads "
                         f"{num_kv_heads}")
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for batch {batch}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens must be [B]=({batch},), got {tuple(context_lens.shape)}")
    context_lens = context_lens.contiguous()

    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # [B, Hq, D]
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    _paged_decode_kernel[(batch, num_kv_heads)](
        query, k_cache, v_cache, out, block_tables, context_lens, float(scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), block_tables.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        GROUP_PAD=triton.next_power_of_2(group), DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_PAD=triton.next_power_of_2(block_size),
    )
    return out
