"""Sizing and allocating the paged KV cache."""

from __future__ import annotations

from pathlib import Path

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


CGROUP_MEMORY = (("memory.max", "memory.current", "memory.stat", "inactive_file"),  # cgroup v2
                 ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
                  "total_inactive_file"))  # v1


def available_host_memory(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process may still fill: the node's MemAvailable, and, under a cgroup memory
    limit (a container's: MemAvailable there is the host's), what the limit leaves beside the
    group's working set (its usage less inactive file pages, which the kernel reclaims first: a
    model read through the page cache). None where neither is known (not Linux)."""
    found = []
    meminfo = _fields(proc / "meminfo")
    if "MemAvailable:" in meminfo:
        found.append(meminfo["MemAvailable:"] * 1024)  # kB
    for limit_file, usage_file, stat_file, inactive in CGROUP_MEMORY:
        try:
            limit = (cgroup / limit_file).read_text().strip()
            usage = int((cgroup / usage_file).read_text())
        except (OSError, ValueError):
            continue
        if limit != "max" and int(limit) < 1 << 60:  # v1 writes a huge number for no limit
            working_set = usage - _fields(cgroup / stat_file).get(inactive, 0)
            found.append(max(int(limit) - working_set, 0))
        break
    return min(found) if found else None


def _fields(path: Path) -> dict[str, int]:
    """A /proc or cgroup file of "name value [unit]" lines as {name: value}; {} if unreadable."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        parts = line.split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1])
    return out


def allocate_kv_cache(arch: Architecture, cache: CacheConfig, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], zeroed. On CPU, a cache
    larger than the memory left (available_host_memory) is refused by name before a byte is
    written: filling it would have the kernel's OOM killer end the replica, and Serve restart it
    into the same end."""
    n = num_blocks_for(arch, cache, dtype, device)
    if device.type == "cpu":
        need, left = n * bytes_per_block(arch, cache.block_size, dtype), available_host_memory()
        if left is not None and need > left:
            option, value = (("num_blocks", n) if cache.num_blocks is not None
                             else ("cpu_kv_cache_bytes", cache.cpu_kv_cache_bytes))
            raise ValueError(f"the KV cache ({option}={value}: {need / 2**30:.2f} GiB) does not fit the "
                             f"{left / 2**30:.2f} GiB of memory left on this node after the model's weights; "
                             f"lower {option}")
    shape = (arch.num_layers, 2, n, cache.block_size, arch.num_kv_heads, arch.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)

