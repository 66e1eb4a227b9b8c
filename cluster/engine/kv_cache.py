"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

import torch

from cluster.config import CacheConfig
from cluster.models.architecture import Architecture


def bytes_per_block(arch: Architecture, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return arch.num_layers * 2 * block_size * arch.num_kv_heads * arch.head_dim * itemsize


def num_blocks_for(arch: Architecture, cache: CacheConfig, dtype: torch.dtype, device: torch.device) -> int:
    """Blocks that fit the budget: bytes on CPU, a fraction of free memory on CUDA."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = bytes_per_block(arch, cache.block_size, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * cache.gpu_memory_utilization)
    else:
        budget = cache.cpu_kv_cache_bytes
    n = budget // per_block
    if n < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of {per_block} bytes")
    return n


def allocate_kv_cache(arch: Architecture, cache: CacheConfig, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zeroed."""
    n = num_blocks_for(arch, cache, dtype, device)
    shape = (arch.num_layers, 2, n, cache.block_size, arch.num_kv_heads, arch.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)

