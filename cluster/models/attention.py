"""Attention over the paged KV cache, with its metadata passed explicitly (no globals).

A step's tokens are flattened into one batch, decode tokens first:

    flat tokens | d0 d1 d2 | p0 p0 p0 p0 | p1 p1 |
                  decodes    prefill chunk  prefill chunk
                  (1 token,  (queries over the cached prefix + themselves, causal)
                   paged kernel)

Decodes run the Triton paged kernel on CUDA, and on CPU in fp32 the C kernel of
kernels/cpu_paged_attention.py, which reads the blocks in place (16 chats of ~225 tokens, the
default model, one thread: a 61 ms engine step -> 47 ms against the gather below); prefill
chunks there run its flash-style causal kernel (1,000 tokens, a layer: 19.8 -> 9.4 ms against
SDPA's fused kernel), with its products in bf16 where the cache is bf16 and the CPU has AVX512-BF16. Where the kernels cannot be built (no C compiler, or
`TANDEM_CPU_KERNELS=0`), or in bf16, the runner instead precomputes, once per
step, each decode sequence's cache slots and validity mask (`CpuDecodeIndex`); every layer
then gathers its K/V rows with one `index_select` into a buffer allocated once per step and
calls SDPA, about 2x faster than walking block tables per layer. (Advanced indexing with the
2-D slot table into a fresh buffer per layer is slower: 16 chats of 45-110 tokens scattered
over 2,048 blocks, 30 layers, one thread: 25 ms that way, 15 ms this way; a whole 16-stream
engine step, 59.5 -> 56.8 ms.) Sequences are grouped by context length first (`DecodeGroup`),
so a batch of short chats with a few long documents does not pad every chat to the longest
context: one gather and one SDPA call per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import KernelOps, sdpa_causal_attention


@dataclass(frozen=True)
class PrefillChunk:
    offset: int  # first flat token index
    num_tokens: int
    context_len: int  # tokens attended to by the chunk's last query (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks] int64: blocks covering context_len


@dataclass(frozen=True)
class DecodeGroup:
    rows: torch.Tensor  # [b] int64: which decode sequences (rows of q)
    slots: torch.Tensor  # [b, Lmax] int64: cache slot of every context position
    valid: torch.Tensor  # [b, 1, 1, Lmax] bool: position < context_len
    gathered: torch.Tensor  # [2, b * Lmax, Hkv, D]: each layer's K/V rows land here in turn


@dataclass(frozen=True)
class CpuDecodeIndex:
    groups: tuple[DecodeGroup, ...]  # sequences of similar context length


@dataclass(frozen=True)
class VerifyGroup:
    """CPU: short chunks over a cached context (speculative verify steps: a token and its
    drafts), batched as decodes are instead of one attention call per chunk. Query j of chunk i
    sees context positions <= its own; a chunk shorter than the group's longest is padded by
    repeating its last row, whose result is the same as that row's, so scattering back is safe.

        rows  [b, Q]: flat token rows      valid [b, 1, Q, L]:  j=0  ■■■■■□□
                                                                j=1  ■■■■■■□   (ctx 7, q 2: last
                                                                j=2  ■■■■■■■    row repeated)
    """

    rows: torch.Tensor  # [b, Q] int64
    slots: torch.Tensor  # [b, L] int64: cache slot of every context position
    valid: torch.Tensor  # [b, 1, Q, L] bool
    gathered: torch.Tensor  # [2, b * L, Hkv, D]


def cpu_verify_index(chunks: list[tuple[int, int, int, list[int]]], block_size: int, kv_row: tuple[int, int],
                     dtype: torch.dtype, device: torch.device) -> tuple[VerifyGroup, ...]:
    """chunks: (first flat row, num tokens, context length after the chunk, block table)."""
    q_max = max(n for _, n, _, _ in chunks)
    length = max(ctx for _, _, ctx, _ in chunks)
    rows = torch.tensor([[offset + min(j, n - 1) for j in range(q_max)] for offset, n, _, _ in chunks],
                        dtype=torch.int64, device=device)
    pos = torch.arange(length, device=device)
    tables = torch.tensor([t + [0] * (-(-length // block_size) - len(t)) for _, _, _, t in chunks],
                          dtype=torch.int64, device=device)
    slots = tables[:, pos // block_size] * block_size + pos % block_size  # [b, L]
    # query j of a chunk of n tokens ending at ctx sits at position ctx - n + min(j, n - 1)
    last = torch.tensor([[ctx - n + min(j, n - 1) for j in range(q_max)] for _, n, ctx, _ in chunks],
                        device=device)  # [b, Q]
    valid = (pos[None, None, :] <= last[:, :, None]).unsqueeze(1)  # [b, 1, Q, L]
    gathered = torch.empty(2, len(chunks) * length, *kv_row, dtype=dtype, device=device)
    return (VerifyGroup(rows, slots, valid, gathered),)


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each flat token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] int32
    decode_context_lens: torch.Tensor  # [Bd] int32
    prefills: tuple[PrefillChunk, ...]
    cpu_decode: CpuDecodeIndex | None = None
    cpu_verify: tuple[VerifyGroup, ...] = ()  # CPU: short chunks with drafts, batched (not in prefills)


def cpu_decode_index(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                     kv_row: tuple[int, int], dtype: torch.dtype) -> CpuDecodeIndex:
    """block_tables [Bd, W] int32, context_lens [Bd] → per length group, slots, mask and a
    gather buffer of (Hkv, D) = `kv_row` rows for the gathered path. A group starts where a
    context is longer than max(2x, +256) its first one, so padding never more than about
    doubles a group's gather."""
    lens = context_lens.long()
    order = torch.argsort(lens).tolist()
    values = lens.tolist()
    groups: list[list[int]] = []
    for i in order:
        if not groups or values[i] > max(2 * values[groups[-1][0]], values[groups[-1][0]] + 256):
            groups.append([])
        groups[-1].append(i)
    out = []
    for members in groups:
        rows = torch.tensor(members, dtype=torch.long, device=lens.device)
        glens = lens[rows]
        pos = torch.arange(int(glens.max()), device=lens.device)  # [Lmax of the group]
        blocks = block_tables.long()[rows][:, pos // block_size]  # [b, Lmax]
        gathered = torch.empty(2, len(members) * len(pos), *kv_row, dtype=dtype, device=lens.device)
        out.append(DecodeGroup(rows, blocks * block_size + pos % block_size, (pos < glens[:, None])[:, None, None, :],
                               gathered))
    return CpuDecodeIndex(tuple(out))


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    ops: KernelOps,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    ops.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    nd = meta.num_decode_tokens
    if not meta.prefills and not meta.cpu_verify:
        return _decode(q, k_cache, v_cache, meta, ops, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, ops, scale)
    for g in meta.cpu_verify:
        _verify(q, out, k_cache, v_cache, g, scale)
    for p in meta.prefills:
        rows = slice(p.offset, p.offset + p.num_tokens)
        if p.context_len == p.num_tokens:  # nothing cached before this chunk: use it directly,
            keys, values = k[rows], v[rows]  # as the cache holds it (a bf16 cache: rounded), so a
            if k_cache.dtype != k.dtype:     # prompt's tokens are the same whichever path reads them
                keys, values = keys.to(k_cache.dtype).to(k.dtype), values.to(v_cache.dtype).to(v.dtype)
        else:
            keys = k_cache[p.block_table].flatten(0, 1)[: p.context_len].to(q.dtype)  # [ctx, Hkv, D]
            values = v_cache[p.block_table].flatten(0, 1)[: p.context_len].to(q.dtype)  # (a bf16 cache: fp32)
        out[rows] = _causal_attention(q[rows], keys, values, scale, ops, k_cache.dtype)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
            ops: KernelOps, scale: float) -> torch.Tensor:
    index = meta.cpu_decode
    if index is None:
        return ops.paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    num_kv_heads, head_dim = k_cache.shape[-2:]
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for g in index.groups:
        b, length = g.slots.shape
        slots, (keys, values) = g.slots.view(-1), g.gathered
        torch.index_select(flat_k, 0, slots, out=keys)
        torch.index_select(flat_v, 0, slots, out=values)
        keys = keys.view(b, length, num_kv_heads, head_dim).transpose(1, 2)  # [b, Hkv, L, D]
        values = values.view(b, length, num_kv_heads, head_dim).transpose(1, 2)
        out[g.rows] = F.scaled_dot_product_attention(q[g.rows].unsqueeze(2), keys, values, attn_mask=g.valid,
                                                     scale=scale, enable_gqa=True).squeeze(2)  # [b, Hq, D]
    return out


def _verify(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: VerifyGroup,
            scale: float) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    (b, length), q_max, num_heads = g.slots.shape, g.rows.shape[1], q.shape[1]
    keys, values = g.gathered
    torch.index_select(k_cache.view(-1, num_kv_heads, head_dim), 0, g.slots.view(-1), out=keys)
    torch.index_select(v_cache.view(-1, num_kv_heads, head_dim), 0, g.slots.view(-1), out=values)
    keys = keys.view(b, length, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)  # [b, Hkv, L, D]
    values = values.view(b, length, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    rows = g.rows.view(-1)
    queries = q[rows].view(b, q_max, num_heads, head_dim).transpose(1, 2)  # [b, Hq, Q, D]
    res = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.valid, scale=scale, enable_gqa=True)
    out[rows] = res.transpose(1, 2).reshape(b * q_max, num_heads, head_dim)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      ops: KernelOps | None = None, kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """q [n, Hq, D] are the last n of the ctx positions in k/v [ctx, Hkv, D]; `kv_dtype`: the
    cache's (bf16: the C kernel may multiply in bf16, as the values already are)."""
    # The C kernel (kernels/cpu_paged_attention.py) is one thread: with more, SDPA spreads out.
    if (ops is not None and ops.prefill_attention is not None and q.shape[-1] % 64 == 0
            and torch.get_num_threads() == 1):
        return ops.prefill_attention(q, k, v, scale, kv_dtype or q.dtype)
    return sdpa_causal_attention(q, k, v, scale)
