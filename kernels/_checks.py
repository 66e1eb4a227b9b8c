"""Argument checks shared by the Triton launchers; errors name the offending argument."""

from __future__ import annotations

import torch
import triton

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# @triton.jit reads TRITON_INTERPRET when it decorates, i.e. when the kernel modules import us.
INTERPRETED = bool(triton.knobs.runtime.interpret)


def check_devices(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, and a CUDA one unless the Triton interpreter is on."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.device != first.device:
            raise ValueError(f"{name} is on {tensor.device} but {first_name} is on {first.device}")
    if first.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"{first_name} is on {first.device}; Triton kernels need CUDA tensors "
                         "(or TRITON_INTERPRET=1 set before kernels is imported)")
    return first.device


def check_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        raise TypeError(f"{name} has dtype {tensor.dtype}; expected one of {allowed}")


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(tensor.shape)}")


def check_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (strides {tensor.stride()})")


def check_same(name: str, tensor: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if tensor.shape != ref.shape or tensor.dtype != ref.dtype:
        raise ValueError(f"{name} {tuple(tensor.shape)} {tensor.dtype} does not match "
                         f"{ref_name} {tuple(ref.shape)} {ref.dtype}")
