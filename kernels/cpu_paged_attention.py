"""Attention on the CPU in C (cpu_paged_attention.c), built once per machine and loaded with
ctypes: paged decode attention that reads K/V from the cache blocks in place, and a
flash-style causal kernel for prefill chunks.

The torch decode path it replaces gathers every decode sequence's K/V rows into a contiguous
buffer each layer (`index_select`) and then runs SDPA over the copy: two passes over the context
plus a write. On the 2-core EPYC, default model, 16 chats of ~200 tokens, one thread, the two
took 27 of a 67 ms engine step (13.6 gather + 12.9 SDPA); this kernel reads each row once. The
prefill kernel takes a 1,000-token layer from SDPA's 19.8 ms to 9.4 (one thread).

Built with the system C compiler (`$CC`, else `cc`) into
`$XDG_CACHE_HOME/tandem/kernels/` (default `~/.cache/tandem/kernels/`), keyed by the source,
the flags and the CPU's feature flags (`-march=native` code must not move to another CPU). A
build goes to a temporary name and is renamed into place, so replicas starting together do
not read half a file. No compiler, a failed build, or `TANDEM_CPU_KERNELS=0`: `load()` returns
None and the engine keeps the torch path (kernels/reference.py's gather + SDPA).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from kernels.reference import sdpa_causal_attention

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".c")
SOURCES = (SOURCE, SOURCE.with_name("cpu_layer_ops.c"),  # one library: see kernels/cpu_layer_ops.py,
           SOURCE.with_name("cpu_block_matmul.c"))  # kernels/block_weights.py
FLAGS = ("-O3", "-march=native", "-ffast-math", "-shared", "-fPIC")
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
KV_DTYPES = (torch.float32, torch.bfloat16)  # what the caches may hold (arithmetic is fp32)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem" / "kernels"


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built library, building it if this machine has none yet; None when unavailable."""
    if os.environ.get("TANDEM_CPU_KERNELS", "1") == "0":
        return None
    cc = os.environ.get("CC", "cc")
    source = b"\0".join(path.read_bytes() for path in SOURCES)
    key = hashlib.sha256(b"\0".join([source, cc.encode(), " ".join(FLAGS).encode(), _cpu_flags().encode()]))
    target = _cache_dir() / f"cpu_paged_attention-{key.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            try:
                subprocess.run([cc, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], check=True, capture_output=True,
                               timeout=120)
                os.replace(tmp, target)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        log.warning("CPU attention kernel unavailable (%s%s); using the torch path", e,
                    f": {detail.decode(errors='replace')[:500]}" if detail else "")
        return None
    for name in ("tandem_paged_decode_f32", "tandem_paged_decode_bf16kv"):
        fn = getattr(lib, name)
        fn.restype = _I64
        fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _PTR]
    for name, restype in (("tandem_prefill_attention_f32", None), ("tandem_prefill_attention_bf16", _I64)):
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _PTR]
    fn = lib.tandem_add_rms_norm
    fn.restype = None
    fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32, _I64, _I64]
    fn = lib.tandem_silu_mul_bf16
    fn.restype = None
    fn.argtypes = [_PTR, _I64, _PTR, _I64, _I64]
    fn = lib.tandem_decode_attention
    fn.restype = _I64
    fn.argtypes = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64,
                   _I64, _F32, _PTR, _PTR, _I64]
    fn = lib.tandem_rope_f32
    fn.restype = None
    fn.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR]
    for name in ("tandem_store_kv_f32", "tandem_store_kv_bf16kv"):
        fn = getattr(lib, name)
        fn.restype = _I64
        fn.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64]
    fn = lib.tandem_block_matmul
    fn.restype = None
    fn.argtypes = [_I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR]
    fn = lib.tandem_block_dequant
    fn.restype = None
    fn.argtypes = [_I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR]
    fn = lib.tandem_block_find
    fn.restype = _I64
    fn.argtypes = [_I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR]
    return lib


def available() -> bool:
    return load() is not None


def built() -> ctypes.CDLL:
    """The library, for a wrapper about to call into it; an error where it could not be built."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not built on this machine (kernels/cpu_paged_attention.py)")
    return lib


def cpu_paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """Same contract as `ref_paged_decode_attention` (kernels/reference.py): query [B, Hq, D],
    caches [num_blocks, block_size, Hkv, D], block_tables [B, W] int32, context_lens [B] int32
    (each >= 1) → [B, Hq, D]. CPU tensors: query float32, caches float32 or bfloat16 (read as
    fp32), contiguous."""
    lib = built()
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if query.dtype != torch.float32 or query.device.type != "cpu":
        raise TypeError(f"query must be a float32 CPU tensor, got {query.dtype} on {query.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype not in KV_DTYPES or t.device.type != "cpu" or t.dtype != k_cache.dtype:
            raise TypeError(f"{name} must be a float32 or bfloat16 CPU tensor as k_cache, got {t.dtype} on {t.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache must be contiguous and of the same shape")
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit caches {tuple(k_cache.shape)}")
    out = torch.empty_like(query)
    if batch == 0:
        return out
    q = query if query.is_contiguous() else query.contiguous()
    tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    lens = context_lens if context_lens.dtype == torch.int32 else context_lens.to(torch.int32)
    tables, lens = tables.contiguous(), lens.contiguous()
    if tables.ndim != 2 or tables.shape[0] != batch or lens.shape != (batch,):
        raise ValueError(f"block_tables {tuple(tables.shape)} / context_lens {tuple(lens.shape)} do not match "
                         f"batch {batch}")
    capacity = tables.shape[1] * block_size  # what a table reaches; the kernel checks each length against it
    scores = torch.empty(num_heads * capacity, dtype=torch.float32)
    kernel = lib.tandem_paged_decode_f32 if k_cache.dtype == torch.float32 else lib.tandem_paged_decode_bf16kv
    bad = kernel(q.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                      tables.data_ptr(), tables.shape[1], lens.data_ptr(), batch, num_heads,
                                      num_kv_heads, head_dim, block_size, scale, scores.data_ptr())
    if bad:
        raise ValueError(f"context_lens must be in [1, {capacity}]")
    return out


_QT, _KT, _RB = 8, 64, 4  # the C file's query tile, key tile and rows per pass


def cpu_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                          products: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal attention of a prefill chunk: query [n, Hq, D] are the last n of the ctx positions
    in key/value [ctx, Hkv, D] (query i sees positions <= ctx - n + i) → [n, Hq, D]. fp32 CPU
    tensors; rows may be strided (views into a fused qkv projection), each row's heads contiguous.
    `products` bfloat16 (a bf16 engine, whose K/V are bf16 values already): Q.K and P.V multiply
    in bf16 with fp32 sums, where the CPU has AVX512-BF16 and D is 64 (elsewhere fp32): a layer
    of 1,024 tokens of the default model, one thread, 2-core EPYC on 2026-11-27: 17.1 -> 11.4 ms."""
    lib = built()
    (n, num_heads, head_dim), (ctx, num_kv_heads, _) = query.shape, key.shape
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    if key.shape != value.shape or key.shape[2] != head_dim or num_heads % num_kv_heads or n > ctx or head_dim % 64:
        raise ValueError(f"query {tuple(query.shape)} does not fit key {tuple(key.shape)} / value "
                         f"{tuple(value.shape)}")
    query, key, value = (t if t.stride(2) == 1 and t.stride(1) == head_dim else t.contiguous()
                         for t in (query, key, value))
    if key.stride(0) != value.stride(0):
        key, value = key.contiguous(), value.contiguous()
    out = torch.empty(n, num_heads, head_dim, dtype=torch.float32)
    if n == 0:
        return out
    rows = _QT * num_heads // num_kv_heads + _RB
    scratch = torch.empty(2 * rows * head_dim + 2 * rows + head_dim * (-(-ctx // _KT) * _KT + 16), dtype=torch.float32)
    args = (query.data_ptr(), query.stride(0), key.data_ptr(), value.data_ptr(), key.stride(0), out.data_ptr(),
            out.stride(0), n, ctx, num_heads, num_kv_heads, head_dim, scale, scratch.data_ptr())
    if products != torch.bfloat16 or lib.tandem_prefill_attention_bf16(*args) != 0:
        lib.tandem_prefill_attention_f32(*args)
    return out


@functools.cache
def avx512() -> bool:
    """This CPU has 512-bit vectors (AVX-512F). The C prefill kernel is written for them (one v16
    a register); on an AVX2-only CPU the compiler splits each into two and spills the tile's
    accumulators: one thread of a 2-core AVX2 EPYC on 2026-11-28, a layer of the default model's
    attention at 1,024 tokens 402 ms against torch's fused SDPA's 38 (ops_for chooses)."""
    return "avx512f" in _cpu_flags().split()


@functools.cache
def amx_bf16() -> bool:
    """This CPU multiplies bf16 tiles (AMX-BF16: Intel Sapphire Rapids and later), where torch's
    fused CPU attention runs its bf16 products as tile instructions."""
    return "amx_bf16" in _cpu_flags().split()


def amx_prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                          products: torch.dtype = torch.float32) -> torch.Tensor:
    """`cpu_prefill_attention`'s contract, through torch's fused (flash) SDPA in bf16 where
    `products` is bfloat16 (a bf16 engine: K/V hold bf16 values, and the o projection that reads
    the result takes it in bf16); float32 products keep the C kernel. On a CPU with AMX, torch
    multiplies the bf16 tiles of Q.K and P.V with tile instructions: one thread of the 2-core
    Xeon (Sapphire Rapids) on 2026-11-28, a layer of the default model's attention (9 query and
    3 K/V heads of 64) at 1,024 tokens 20.6 -> 5.7 ms, the second 512-token chunk of a 1,024-token
    prompt 14.7 -> 4.8 ms, 128 tokens 0.61 -> 0.16 ms (the C kernel's bf16 products against
    this). Without AMX the C kernel is the faster one (ops_for chooses)."""
    if products != torch.bfloat16:
        return cpu_prefill_attention(query, key, value, scale, products)
    (n, num_heads, head_dim), ctx = query.shape, key.shape[0]
    if key.shape != value.shape or key.shape[2] != head_dim or num_heads % key.shape[1] or n > ctx:
        raise ValueError(f"query {tuple(query.shape)} does not fit key {tuple(key.shape)} / value "
                         f"{tuple(value.shape)}")
    return sdpa_causal_attention(query, key, value, scale, torch.bfloat16)
