"""KV-cache kernels: Triton launchers for CUDA; C attention kernels (paged decode, causal
prefill) and pure-torch references for CPU.

`ops_for(device, dtype)` picks the set the engine should call; every set shares signatures.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from kernels import cpu_paged_attention
from kernels.cpu_paged_attention import cpu_paged_decode_attention, cpu_prefill_attention
from kernels.pack_kv import pack_kv, unpack_kv
from kernels.paged_attention import paged_decode_attention
from kernels.reference import (ref_pack_kv, ref_paged_decode_attention, ref_store_kv,
                               ref_unpack_kv)
from kernels.store_kv import store_kv

__all__ = [
    "KernelOps", "ops_for",
    "store_kv", "paged_decode_attention", "pack_kv", "unpack_kv",
    "cpu_paged_decode_attention", "cpu_prefill_attention",
    "ref_store_kv", "ref_paged_decode_attention", "ref_pack_kv", "ref_unpack_kv",
]


class KernelOps(NamedTuple):
    store_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    pack_kv: Callable[..., torch.Tensor]
    unpack_kv: Callable[..., None]
    # False: `paged_decode_attention` is only a reference, and the CPU engine gathers each
    # decode's K/V rows with its own index (cluster/models/attention.py) rather than call it.
    decode_in_place: bool = True
    # causal attention of a prefill chunk over contiguous K/V ([n, Hq, D] queries, [ctx, Hkv, D]);
    # None: torch's SDPA (cluster/models/attention.py)
    prefill_attention: Callable[..., torch.Tensor] | None = None


TRITON_OPS = KernelOps(store_kv, paged_decode_attention, pack_kv, unpack_kv)
REFERENCE_OPS = KernelOps(ref_store_kv, ref_paged_decode_attention, ref_pack_kv, ref_unpack_kv, False)
CPU_OPS = REFERENCE_OPS._replace(paged_decode_attention=cpu_paged_decode_attention, decode_in_place=True,
                                 prefill_attention=cpu_prefill_attention)


def ops_for(device: torch.device, dtype: torch.dtype = torch.float32) -> KernelOps:
    """Triton launchers on CUDA devices; on the CPU in float32, the C attention kernels where this
    machine can build them (kernels/cpu_paged_attention.py); the torch references otherwise."""
    if device.type == "cuda":
        return TRITON_OPS
    if dtype == torch.float32 and cpu_paged_attention.available():
        return CPU_OPS
    return REFERENCE_OPS
