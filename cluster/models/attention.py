"""Attention over the paged KV cache, with its metadata passed explicitly (no globals).

A step's tokens are flattened into one batch, decode tokens first:

    flat tokens | d0 d1 d2 | p0 p0 p0 p0 | p1 p1 |
                  decodes    prefill chunk  prefill chunk
                  (1 token,  (queries over the cached prefix + themselves, causal)
                   paged kernel)

Decodes run the Triton paged kernel on CUDA. On CPU the runner instead precomputes, once per
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
from typing import Hashable, Sequence

import torch
import torch.nn.functional as F

from kernels import KernelOps


@dataclass(frozen=True)
class PrefillChunk:
    offset: int  # first flat token index
    num_tokens: int
    context_len: int  # tokens attended to by the chunk's last query (cached prefix + chunk)
    block_table: torch.Tensor  # [num_blocks] int64: blocks covering context_len


@dataclass(frozen=True)
class DecodeGroup:
    rows: torch.Tensor  # [b] int64: which decode sequences (rows of q)
    slots: torch.Tensor  # [b, W] int64: cache slot of every context position (W: Lmax, or the mirror's width)
    valid: torch.Tensor  # [b, 1, 1, Lmax] bool: position < context_len
    gathered: torch.Tensor  # [2, b * W, Hkv, D]: each layer's K/V rows land here in turn
    # with a mirror (`DecodeMirrors`): per layer (keyed by its cache's data_ptr) [2, b, W, Hkv, D],
    # kept across steps; `fill`: gather every position into it this step, else write only each
    # row's new token, at `last` [b] int64
    mirror: dict[int, torch.Tensor] | None = None
    fill: bool = True
    last: torch.Tensor | None = None


class DecodeMirrors:
    """CPU decode without copying every context every step. Gathering a decode group's K/V out of
    the paged cache copies each sequence's whole context twice per layer per step (16 chats of
    ~300 tokens: ~220 MB a step, ~16% of the step here, docs/performance.md). A group whose
    sequences are the same as last step's, each one token further on, keeps last step's gathered
    rows instead (its mirror, one per layer) and appends each row's new token to them. A group
    that changed (a sequence joined, left, was preempted, verified drafts) gathers afresh into a
    new mirror a little wider than it needs, so the next steps append in place. Mirrors not used in
    a step are dropped; past `max_bytes` in all, a group gathers as before (no mirror)."""

    def __init__(self, layer_keys: list[int], kv_row: tuple[int, int], dtype: torch.dtype,
                 max_bytes: int, slack: int = 32) -> None:
        self.layer_keys = layer_keys  # each layer's cache data_ptr: the key `_decode` looks up
        self.kv_row = kv_row
        self.dtype = dtype
        self.max_bytes = max_bytes
        self.slack = slack
        self.entries: dict[tuple[Hashable, ...], tuple[list[int], int, dict[int, torch.Tensor]]] = {}
        self._next: dict[tuple[Hashable, ...], tuple[list[int], int, dict[int, torch.Tensor]]] = {}

    def take(self, rids: tuple[Hashable, ...], lens: list[int]) -> tuple[dict[int, torch.Tensor], bool, int] | None:
        """(per-layer mirrors, fill, width) for a group of requests (`rids`: whatever names each
        one uniquely) at context `lens`; None: no mirror."""
        prev = self.entries.get(rids)
        if prev is not None:
            prev_lens, width, mirror = prev
            if max(lens) <= width and all(n == p + 1 for n, p in zip(lens, prev_lens)):
                self._next[rids] = (lens, width, mirror)
                return mirror, False, width
        width = max(lens) + self.slack
        row_bytes = self.kv_row[0] * self.kv_row[1] * torch.finfo(self.dtype).bits // 8
        need = 2 * len(rids) * width * row_bytes * len(self.layer_keys)
        held = sum(2 * len(k) * w * row_bytes * len(self.layer_keys) for k, (_, w, _) in self._next.items())
        if held + need > self.max_bytes:
            return None
        mirror = {key: torch.empty(2, len(rids), width, *self.kv_row, dtype=self.dtype) for key in self.layer_keys}
        self._next[rids] = (lens, width, mirror)
        return mirror, True, width

    def end_step(self) -> None:
        """The groups used in this step are the ones kept; the rest are freed."""
        self.entries, self._next = self._next, {}


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
                     kv_row: tuple[int, int], dtype: torch.dtype, request_ids: Sequence[Hashable] | None = None,
                     mirrors: DecodeMirrors | None = None) -> CpuDecodeIndex:
    """block_tables [Bd, W] int32, context_lens [Bd] → per length group, slots, mask and a
    gather buffer of (Hkv, D) = `kv_row` rows for the gathered path. A group starts where a
    context is longer than max(2x, +256) its first one, so padding never more than about
    doubles a group's gather. With `mirrors` (and each decode row's request id), a group keeps
    its gathered rows across steps (`DecodeMirrors`)."""
    lens = context_lens.long()
    order = torch.argsort(lens, stable=True).tolist()
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
        lmax = int(glens.max())
        taken = (mirrors.take(tuple(request_ids[i] for i in members), [values[i] for i in members])
                 if mirrors is not None and request_ids is not None else None)
        width = lmax if taken is None else taken[2]
        pos = torch.arange(width, device=lens.device)
        valid = (pos[:lmax] < glens[:, None])[:, None, None, :]
        if taken is not None and not taken[1]:  # append only: no slots, no gather buffer
            empty = torch.empty(0, dtype=torch.long)
            out.append(DecodeGroup(rows, empty, valid, torch.empty(0, dtype=dtype), taken[0], False, glens - 1))
            continue
        # positions past a context (a mirror's slack, a shorter row) read block 0: masked out
        blocks = block_tables.long()[rows][:, torch.clamp(pos // block_size, max=block_tables.shape[1] - 1)]
        slots = torch.where(pos < glens[:, None], blocks * block_size + pos % block_size, 0)
        if taken is not None:
            out.append(DecodeGroup(rows, slots, valid, torch.empty(0, dtype=dtype), taken[0], True, glens - 1))
            continue
        gathered = torch.empty(2, len(members) * width, *kv_row, dtype=dtype, device=lens.device)
        out.append(DecodeGroup(rows, slots, valid, gathered))
    if mirrors is not None:
        mirrors.end_step()
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
        return _decode(q, k_cache, v_cache, meta, ops, scale, k, v)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, ops, scale, k[:nd], v[:nd])
    for g in meta.cpu_verify:
        _verify(q, out, k_cache, v_cache, g, scale)
    for p in meta.prefills:
        rows = slice(p.offset, p.offset + p.num_tokens)
        if p.context_len == p.num_tokens:  # nothing cached before this chunk: use it directly
            keys, values = k[rows], v[rows]
        else:
            keys = k_cache[p.block_table].flatten(0, 1)[: p.context_len]  # [ctx, Hkv, D]
            values = v_cache[p.block_table].flatten(0, 1)[: p.context_len]
        out[rows] = _causal_attention(q[rows], keys, values, scale)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
            ops: KernelOps, scale: float, k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
    """k_new, v_new [Bd, Hkv, D]: this step's K/V of the decode rows (already in the cache)."""
    index = meta.cpu_decode
    if index is None:
        return ops.paged_decode_attention(
            q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    num_kv_heads, head_dim = k_cache.shape[-2:]
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for g in index.groups:
        length = g.valid.shape[-1]
        if g.mirror is None:
            b, width = g.slots.shape
            keys, values = g.gathered
        else:
            keys, values = g.mirror[k_cache.data_ptr()]  # [b, W, Hkv, D] each
            b, width = keys.shape[:2]
            if not g.fill:  # last step's rows are there: add this step's token
                at = torch.arange(b)
                keys[at, g.last] = k_new[g.rows]
                values[at, g.last] = v_new[g.rows]
            keys, values = keys.view(b * width, num_kv_heads, head_dim), values.view(b * width, num_kv_heads, head_dim)
        if g.fill:
            torch.index_select(flat_k, 0, g.slots.view(-1), out=keys)
            torch.index_select(flat_v, 0, g.slots.view(-1), out=values)
        keys = keys.view(b, width, num_kv_heads, head_dim)[:, :length].transpose(1, 2)  # [b, Hkv, L, D]
        values = values.view(b, width, num_kv_heads, head_dim)[:, :length].transpose(1, 2)
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
    keys = keys.view(b, length, num_kv_heads, head_dim).transpose(1, 2)  # [b, Hkv, L, D]
    values = values.view(b, length, num_kv_heads, head_dim).transpose(1, 2)
    rows = g.rows.view(-1)
    queries = q[rows].view(b, q_max, num_heads, head_dim).transpose(1, 2)  # [b, Hq, Q, D]
    res = F.scaled_dot_product_attention(queries, keys, values, attn_mask=g.valid, scale=scale, enable_gqa=True)
    out[rows] = res.transpose(1, 2).reshape(b * q_max, num_heads, head_dim)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] are the last n of the ctx positions in k/v [ctx, Hkv, D]."""
    n, ctx = q.shape[0], k.shape[0]
    # [1, H, n|ctx, D]: with a batch dimension torch's CPU SDPA takes its fused flash kernel
    # (blocked, causal blocks skipped); 3-D inputs take the unfused math path, which at 1,024
    # tokens costs ~4x as much (79 vs 19 ms a layer, one thread) and dominated long prefills.
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if n == ctx:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    else:
        rows = torch.arange(ctx - n, ctx, device=q.device)[:, None]
        mask = torch.arange(ctx, device=q.device)[None, :] <= rows  # [n, ctx]
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
