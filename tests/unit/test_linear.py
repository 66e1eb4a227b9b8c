"""A projection with bfloat16 weights beside float32 activations (a CPU engine's `dtype:
bfloat16`): the product comes back in float32, within bf16's rounding of the fp32 product, packed
for oneDNN where the CPU computes bf16 natively; a CPU that cannot is refused, not slowed."""

from __future__ import annotations

import pytest
import torch

from cluster.engine import model_runner
from cluster.engine.model_runner import weight_dtypes
from cluster.models.linear import Linear, onednn_packing

native_bf16 = pytest.mark.skipif(not onednn_packing(torch.bfloat16),
                                 reason="this CPU has no native bf16 (AVX512-BF16 or AMX)")


@native_bf16
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_weights_multiply_float32_rows_within_bf16_rounding(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=gen) / 8
    b = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 64, generator=gen)
    full = Linear(w, b)
    exact = full(x)
    half = Linear(w.bfloat16(), None if b is None else b.bfloat16())
    got = half(x)
    assert half.packed and full.packed
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    # bf16 keeps 8 bits of mantissa: inputs and weights each rounded by <= 2^-9 relative
    scale = (x.abs() @ w.abs().t()).max()
    assert (got - exact).abs().max() <= 2 ** -6 * scale
    assert half.float_out(x).dtype == torch.float32


def test_float32_weights_are_left_as_they_were():
    assert weight_dtypes(torch.float32, torch.device("cpu")) == (torch.float32, None)


@native_bf16
def test_bfloat16_on_cpu_multiplies_in_bf16_and_keeps_the_rest_float32():
    assert weight_dtypes(torch.bfloat16, torch.device("cpu")) == (torch.float32, torch.bfloat16)


def test_bfloat16_on_a_cpu_without_native_bf16_is_refused_with_what_to_use(monkeypatch):
    monkeypatch.setattr(model_runner, "onednn_packing", lambda dtype=torch.float32: dtype != torch.bfloat16)
    with pytest.raises(ValueError, match="use float32"):
        weight_dtypes(torch.bfloat16, torch.device("cpu"))
