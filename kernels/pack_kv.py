"""Gather a request's KV blocks into one contiguous buffer (and scatter them back).

Every (layer, K/V) plane of the cache is a run of equal-size blocks, so one block is one
contiguous chunk of `block_size * Hkv * D` elements:

    kv_cache [L, 2, N, bs, Hkv, D]        packed [L, 2, n, bs, Hkv, D]
    plane p = layer * 2 + kv
    src chunk (p * N + block_ids[i])  <->  dst chunk (p * n + i)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_contiguous, check_devices, check_dtype, check_ndim

_TILE = 1024


@triton.jit
def _copy_blocks_kernel(
    kv_cache_ptr, packed_ptr, block_ids_ptr, num_cache_blocks, num_packed, chunk,
    TO_PACKED: tl.constexpr, TILE: tl.constexpr,
):
    i = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * TILE + tl.arange(0, TILE)
    mask = offs < chunk
    block_id = tl.load(block_ids_ptr + i).to(tl.int64)
    cache_offs = (plane * num_cache_blocks + block_id) * chunk + offs
    packed_offs = (plane * num_packed + i) * chunk + offs
    if TO_PACKED:
        tl.store(packed_ptr + packed_offs, tl.load(kv_cache_ptr + cache_offs, mask=mask), mask=mask)
    else:
        tl.store(kv_cache_ptr + cache_offs, tl.load(packed_ptr + packed_offs, mask=mask), mask=mask)


def _block_index(block_ids: torch.Tensor | list[int], kv_cache: torch.Tensor) -> torch.Tensor:
    if not isinstance(block_ids, torch.Tensor):
        block_ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    check_devices(kv_cache=kv_cache, block_ids=block_ids)
    check_dtype("block_ids", block_ids, (torch.int32, torch.int64))
    check_ndim("block_ids", block_ids, 1, "[n]")
    return block_ids.contiguous()  # [n]


def _check_cache(kv_cache: torch.Tensor) -> None:
    check_ndim("kv_cache", kv_cache, 6, "[num_layers, 2, num_blocks, block_size, Hkv, D]")
    check_contiguous("kv_cache", kv_cache)


def _launch(kv_cache: torch.Tensor, packed: torch.Tensor, block_ids: torch.Tensor,
            to_packed: bool) -> None:
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    n = block_ids.shape[0]
    chunk = block_size * num_kv_heads * head_dim
    if n == 0 or chunk == 0:
        return
    tile = min(_TILE, triton.next_power_of_2(chunk))
    grid = (n, num_layers * 2, triton.cdiv(chunk, tile))
    _copy_blocks_kernel[grid](kv_cache, packed, block_ids, num_blocks, n, chunk,
                              TO_PACKED=to_packed, TILE=tile)


def pack_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor | list[int]) -> torch.Tensor:
    """Copy blocks `block_ids` (in order) of every layer into a new contiguous buffer.

    kv_cache:  [L, 2, N, block_size, Hkv, D], contiguous
    block_ids: [n] int32/int64 tensor on kv_cache's device, or a list of ints
    Returns    [L, 2, n, block_size, Hkv, D], contiguous, kv_cache's dtype.
    """
    _check_cache(kv_cache)
    ids = _block_index(block_ids, kv_cache)
    shape = kv_cache.shape
    packed = kv_cache.new_empty((shape[0], shape[1], ids.shape[0], *shape[3:]))
    _launch(kv_cache, packed, ids, to_packed=True)
    return packed


def unpack_kv(packed: torch.Tensor, kv_cache: torch.Tensor,
              block_ids: torch.Tensor | list[int]) -> None:
    """Inverse of `pack_kv`: write packed `[L, 2, n, bs, Hkv, D]` into blocks `block_ids`.

    block_ids must be distinct; the write is in place.
    """
    _check_cache(kv_cache)
    ids = _block_index(block_ids, kv_cache)
    check_devices(kv_cache=kv_cache, packed=packed)
    shape = kv_cache.shape
    expected = (shape[0], shape[1], ids.shape[0], *shape[3:])
    if packed.shape != expected:
        raise ValueError(f"packed must be {expected} for {ids.shape[0]} blocks, "
                         f"got {tuple(packed.shape)}")
    if packed.dtype != kv_cache.dtype:
        raise TypeError(f"packed has dtype {packed.dtype} but kv_cache has {kv_cache.dtype}")
    check_contiguous("packed", packed)
    _launch(kv_cache, packed, ids, to_packed=False)
