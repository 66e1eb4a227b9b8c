"""Pure-torch references for the kernels; also the CPU path the engine runs.

Cache layout (shared by every kernel):

    kv_cache: [num_layers, 2, num_blocks, block_size, Hkv, D]   (0 = K, 1 = V)
    k_cache = kv_cache[l, 0]: [num_blocks, block_size, Hkv, D]

    slot = block_id * block_size + offset_in_block

    block_tables[b] = [ 7, 2, 9, x, x ]      (x: padding, never read)
    token pos 21 of seq b, block_size 8  ->  block_tables[b][21 // 8] = 9
                                         ->  slot 9 * 8 + 21 % 8 = 77
"""

from __future__ import annotations

import torch


def ref_store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value `[T, Hkv, D]` into slots `[T]` of the caches; slots < 0 are skipped."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key[keep].to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value[keep].to(v_cache.dtype))


def ref_paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """One decode token per sequence attending to its first `context_lens[b]` cached tokens.

    query `[B, Hq, D]`, caches `[num_blocks, block_size, Hkv, D]`, block_tables `[B, max_blocks]`,
    context_lens `[B]` (each >= 1). Query head h reads kv head h // (Hq // Hkv).
    Returns `[B, Hq, D]` in query's dtype; softmax in float32.
    """
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if batch == 0:
        return torch.empty_like(query)
    lens = context_lens.long()
    max_len = int(lens.max())
    num_blocks = -(-max_len // block_size)

    used = torch.arange(num_blocks, device=query.device) < (-(-lens // block_size))[:, None]
    tables = torch.where(used, block_tables[:, :num_blocks].long(), 0)  # [B, nblk]
    valid = torch.arange(max_len, device=query.device) < lens[:, None]  # [B, L]

    def gather(cache: torch.Tensor) -> torch.Tensor:
        blocks = cache[tables].flatten(1, 2)[:, :max_len].float()  # [B, L, Hkv, D]
        return blocks.masked_fill_(~valid[:, :, None, None], 0.0)

    k = gather(k_cache).permute(0, 2, 3, 1)  # [B, Hkv, D, L]
    v = gather(v_cache).transpose(1, 2)  # [B, Hkv, L, D]
    q = query.float().view(batch, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]

    scores = torch.matmul(q, k).mul_(scale)  # [B, Hkv, G, L]
    scores.masked_fill_(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [B, Hkv, G, D]
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def sdpa_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                          dtype: torch.dtype | None = None) -> torch.Tensor:
    """Causal attention of a prefill chunk through torch's SDPA: query [n, Hq, D] are the last n
    of the ctx positions in key/value [ctx, Hkv, D] (query i sees positions <= ctx - n + i) → [n,
    Hq, D] in query's dtype, computed in `dtype` (default: query's). With a batch dimension
    ([1, H, n|ctx, D]) torch's CPU SDPA takes its fused flash kernel; 3-D inputs take the unfused
    math path, which at 1,024 tokens costs ~4x as much (79 vs 19 ms a layer, one thread)."""
    n, ctx = query.shape[0], key.shape[0]
    qh, kh, vh = (t.to(dtype or query.dtype).transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    if n == ctx:
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                               enable_gqa=True)
    else:
        rows = torch.arange(ctx - n, ctx, device=query.device)[:, None]
        mask = torch.arange(ctx, device=query.device)[None, :] <= rows  # [n, ctx]
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale,
                                                               enable_gqa=True)
    return out[0].transpose(0, 1).to(query.dtype)


def _as_index(block_ids: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(device=device, dtype=torch.long)
    return torch.tensor(block_ids, device=device, dtype=torch.long)


def ref_pack_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """Copy blocks `[n]` of kv_cache `[L, 2, N, bs, Hkv, D]` into a new `[L, 2, n, bs, Hkv, D]`."""
    return kv_cache.index_select(2, _as_index(block_ids, kv_cache.device))


def ref_unpack_kv(packed: torch.Tensor, kv_cache: torch.Tensor,
                  block_ids: torch.Tensor | list[int]) -> None:
    """Inverse of `ref_pack_kv`: write packed `[L, 2, n, bs, Hkv, D]` into blocks `[n]`, in place."""
    kv_cache.index_copy_(2, _as_index(block_ids, kv_cache.device), packed)
