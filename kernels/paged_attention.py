"""Paged decode attention: one query token per sequence over its blocks of cached K/V.

One program per (sequence, kv head, split) handles the G = Hq // Hkv query heads that share
the kv head, over one split of SPLIT_TOKENS context positions, TILE positions at a time (a
tile spans several blocks: their ids are loaded together, so the loads of a tile's K/V rows
are in flight at once), with an online softmax:

    block_tables[b] = [ 7, 2, 9, x ]       context_len 21, block_size 8, TILE 16
    tile 0: positions 0..15  -> blocks 7, 2     tile 1: positions 16..20 (masked at >= 21) -> 9
    token row of (block 9, offset 4):  k_cache[(9 * 8 + 4) * Hkv + kv_head] -> [D]

With one split the program writes the output. With several (long contexts: flash-decoding)
each writes its normalized partial output and log-sum-exp, and a second kernel combines them;
a split past a sequence's end is empty (lse = -inf, weight 0). The number of splits follows
the block table's width, not the context lengths, so a CUDA graph captures a fixed grid.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels._checks import (FLOAT_DTYPES, check_contiguous, check_devices, check_dtype,
                             check_ndim, check_same)

# Chosen on an H100 (bf16, default model's heads; README, On a GPU): against one program per
# (sequence, kv head) walking one block at a time, 1 sequence x 4,000 tokens 594 -> 31 µs,
# 64 x 2,048 412 -> 203 µs, 1 x 100 18 -> 17 µs; a tile of 128 was slower than 32 everywhere.
TILE = 32  # context positions per loop iteration
SPLIT_TOKENS = 256  # context positions per program, unless the batch alone fills the GPU
PROGRAMS_PER_SM = 4  # ... which it does at batch x Hkv >= this x the GPU's multiprocessors


@functools.cache  # called per layer per eager step
def _multiprocessors(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, tables_ptr, lens_ptr, scale,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_os, stride_tb, stride_tj,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    TILE: tl.constexpr, SPLIT_TOKENS: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    t = tl.arange(0, TILE)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)

    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=q_mask, other=0.0).to(tl.float32) * scale  # [G, D]
    context_len = tl.load(lens_ptr + seq)
    begin = split * SPLIT_TOKENS
    end = tl.minimum(context_len, begin + SPLIT_TOKENS)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    denom = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for start in range(begin, end, TILE):
        pos = start + t  # [T]
        t_mask = pos < end
        kv_mask = t_mask[:, None] & (d[None, :] < HEAD_DIM)
        block_id = tl.load(tables_ptr + seq * stride_tb + (pos // BLOCK_SIZE) * stride_tj,
                           mask=t_mask, other=0).to(tl.int64)
        rows = (block_id * BLOCK_SIZE + pos % BLOCK_SIZE) * NUM_KV_HEADS + kv_head  # [T]
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

    out = acc / tl.maximum(denom, 1e-30)[:, None]  # an empty split: 0, weighted 0 below
    out_offs = seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    if NUM_SPLITS > 1:
        lse = m + tl.log(denom)  # -inf for an empty split
        tl.store(lse_ptr + (seq * GROUP * NUM_KV_HEADS + heads) * NUM_SPLITS + split, lse,
                 mask=g < GROUP)


@triton.jit
def _combine_splits_kernel(
    part_ptr, lse_ptr, out_ptr, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """part [B, Hq, S, D] fp32 and lse [B, Hq, S] → out [B, Hq, D]: each split weighted by
    exp(lse - max lse)."""
    row = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)  # b * Hq + h
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    s_mask = s < NUM_SPLITS
    lse = tl.load(lse_ptr + row * NUM_SPLITS + s, mask=s_mask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))  # [S]
    parts = tl.load(part_ptr + (row * NUM_SPLITS + s[:, None]) * HEAD_DIM + d[None, :],
                    mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(w[:, None] * parts, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + tl.program_id(0) * stride_ob + tl.program_id(1) * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor,
                           scale: float, split_tokens: int | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged K/V (already stored).

    query:            [B, Hq, D], last dim contiguous; Hq % Hkv == 0
    k_cache, v_cache: [num_blocks, block_size, Hkv, D], contiguous, query's dtype
    block_tables:     [B, max_blocks] int32; entries past a sequence's last block are ignored
    context_lens:     [B] int32, tokens to attend to (>= 1, including the new one)
    split_tokens:     context positions per program; the splits cover block_tables' width.
                      None: SPLIT_TOKENS, or one split when batch x Hkv alone fills the GPU
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
    width = max(1, block_tables.shape[1] * block_size)
    if split_tokens is None:
        sms = _multiprocessors(query.device)
        split_tokens = width if sms and batch * num_kv_heads >= PROGRAMS_PER_SM * sms else SPLIT_TOKENS
    tile = min(TILE, triton.next_power_of_2(split_tokens))
    splits = -(-width // split_tokens)
    meta = dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                GROUP_PAD=triton.next_power_of_2(group), DIM_PAD=triton.next_power_of_2(head_dim),
                TILE=tile, SPLIT_TOKENS=split_tokens, NUM_SPLITS=splits)
    if splits == 1:
        part, lse = out, out  # lse is not written with one split
    else:
        part = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
        lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=query.device)
    _paged_decode_kernel[(batch, num_kv_heads, splits)](
        query, k_cache, v_cache, part, lse, block_tables, context_lens, float(scale),
        query.stride(0), query.stride(1), part.stride(0), part.stride(1),
        part.stride(2) if splits > 1 else 0, block_tables.stride(0), block_tables.stride(1), **meta)
    if splits > 1:
        _combine_splits_kernel[(batch, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), HEAD_DIM=head_dim,
            DIM_PAD=triton.next_power_of_2(head_dim), NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits))
    return out
