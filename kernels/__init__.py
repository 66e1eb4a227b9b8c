"""KV-cache kernels: Triton launchers for CUDA, pure-torch references for CPU.

`ops_for(device)` picks the set the engine should call; both sets share signatures.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from kernels.pack_kv import pack_kv, unpack_kv
from kernels.paged_attention import paged_decode_attention
from kernels.reference import (ref_pack_kv, ref_paged_decode_attention, ref_store_kv,
                               ref_unpack_kv)
from kernels.store_kv import store_kv

__all__ = [
    "KernelOps", "ops_for",
    "store_kv", "paged_decode_attention", "pack_kv", "unpack_kv",
    "ref_store_kv", "ref_paged_decode_attention", "ref_pack_kv", "ref_unpack_kv",
]


class KernelOps(NamedTuple):
    store_kv: Callable[..., None]
    paged_decode_attention: Callable[..., torch.Tensor]
    pack_kv: Callable[..., torch.Tensor]
    unpack_kv: Callable[..., None]


TRITON_OPS = KernelOps(store_kv, paged_decode_attention, pack_kv, unpack_kv)
REFERENCE_OPS = KernelOps(ref_store_kv, ref_paged_decode_attention, ref_pack_kv, ref_unpack_kv)


def ops_for(device: torch.device) -> KernelOps:
    """Triton launchers on CUDA devices, the torch references everywhere else."""
    return TRITON_OPS if device.type == "cuda" else REFERENCE_OPS
