"""The CPU KV cache's start-up check: a cache larger than the memory left is refused by name."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cluster.config import CacheConfig
from cluster.engine import kv_cache
from cluster.engine.kv_cache import allocate_kv_cache, available_host_memory, bytes_per_block

GIB = 1 << 30


def write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def meminfo(available_kb: int) -> dict[str, str]:
    return {"meminfo": f"MemTotal:       33554432 kB\nMemFree:         1000000 kB\n"
                       f"MemAvailable:   {available_kb} kB\n"}


def test_the_memory_left_is_the_nodes_available_memory_or_less_under_a_containers_limit(tmp_path):
    proc = write(tmp_path / "proc", meminfo(8 * 1024 * 1024))  # 8 GiB available on the host
    assert available_host_memory(proc, tmp_path / "no-cgroup") == 8 * GIB
    # cgroup v2, a 4 GiB limit: 3 GiB used of which 1 GiB is inactive page cache (a model read in)
    v2 = write(tmp_path / "v2", {"memory.max": f"{4 * GIB}\n", "memory.current": f"{3 * GIB}\n",
                                 "memory.stat": f"anon {2 * GIB}\ninactive_file {GIB}\n"})
    assert available_host_memory(proc, v2) == 2 * GIB
    unlimited = write(tmp_path / "v2max", {"memory.max": "max\n", "memory.current": f"{3 * GIB}\n"})
    assert available_host_memory(proc, unlimited) == 8 * GIB
    v1 = write(tmp_path / "v1", {"memory/memory.limit_in_bytes": f"{6 * GIB}\n",
                                 "memory/memory.usage_in_bytes": f"{5 * GIB}\n",
                                 "memory/memory.stat": f"inactive_file 4096\ntotal_inactive_file {2 * GIB}\n"})
    assert available_host_memory(proc, v1) == 3 * GIB
    v1_unlimited = write(tmp_path / "v1max", {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                                              "memory/memory.usage_in_bytes": f"{5 * GIB}\n"})
    assert available_host_memory(proc, v1_unlimited) == 8 * GIB
    assert available_host_memory(tmp_path / "nothing", tmp_path / "nothing") is None


def test_this_machine_reports_the_memory_left():
    left = available_host_memory()
    total = int(next(line for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemTotal:")).split()[1]) * 1024
    assert left is not None and 0 < left <= total


ARCH = SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8)  # what sizes a block


def test_a_kv_cache_larger_than_the_memory_left_is_refused_by_its_option(monkeypatch):
    monkeypatch.setattr(kv_cache, "available_host_memory", lambda: 1 << 20)  # 1 MiB left
    with pytest.raises(ValueError, match=r"cpu_kv_cache_bytes=4194304: 0\.00 GiB\) does not fit .* lower "
                                         r"cpu_kv_cache_bytes"):
        allocate_kv_cache(ARCH, CacheConfig(cpu_kv_cache_bytes=4 << 20), torch.float32, torch.device("cpu"))
    per_block = bytes_per_block(ARCH, 16, torch.float32)
    with pytest.raises(ValueError, match="num_blocks=1000.* lower num_blocks"):
        allocate_kv_cache(ARCH, CacheConfig(num_blocks=1000), torch.float32, torch.device("cpu"))
    cache = allocate_kv_cache(ARCH, CacheConfig(num_blocks=(1 << 20) // per_block), torch.float32,
                              torch.device("cpu"))  # what fits is allocated, zeroed
    assert cache.shape[2] == (1 << 20) // per_block and not cache.any()
