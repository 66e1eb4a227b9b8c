"""A projection with bfloat16 weights beside float32 activations (a CPU engine's `dtype:
bfloat16`): the product comes back in float32, within bf16's rounding of the fp32 product, packed
for oneDNN where the CPU computes bf16 natively; a CPU that cannot is refused, not slowed; and
which CPUs `dtype: auto` runs in bf16."""

from __future__ import annotations

import re

import pytest
import torch

from cluster.engine import model_runner
from cluster.engine.model_runner import weight_dtypes
from cluster.models import linear
from cluster.models.linear import Linear, RefinedHead, onednn_packing

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


@pytest.mark.parametrize("flags, vendor, expected", [
    ("avx512f avx512_bf16 amx_bf16 amx_tile", "GenuineIntel", torch.bfloat16),  # Sapphire Rapids on
    ("avx512f avx512_bf16", "AuthenticAMD", torch.bfloat16),  # Zen 4 and 5
    ("avx512f avx512_bf16 avx512_fp16", "GenuineIntel", torch.float32),  # AMX hidden: bf16 is slower
    ("avx512f avx2", "AuthenticAMD", torch.float32),  # no native bf16
    ("avx2 fma", "GenuineIntel", torch.float32),
])
def test_auto_is_bfloat16_only_on_a_cpu_where_it_beats_float32(monkeypatch, flags, vendor, expected):
    monkeypatch.setattr(linear, "_cpu_identity", lambda: (flags.split(), vendor))
    monkeypatch.setattr(model_runner, "onednn_packing", lambda dtype=torch.float32: True)
    assert model_runner.pick_dtype("auto", torch.device("cpu")) == expected
    assert model_runner.pick_dtype("float32", torch.device("cpu")) == torch.float32
    assert model_runner.pick_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16  # asked for: runs


def test_auto_is_float32_where_onednn_cannot_pack_bf16(monkeypatch):
    monkeypatch.setattr(linear, "_cpu_identity", lambda: (["avx512f", "amx_bf16"], "GenuineIntel"))
    monkeypatch.setattr(model_runner, "onednn_packing", lambda dtype=torch.float32: dtype != torch.bfloat16)
    assert model_runner.pick_dtype("auto", torch.device("cpu")) == torch.float32


def test_the_cpu_identity_is_read_from_proc_cpuinfo():
    """What `auto` decides on: the first CPU's flags and vendor, as /proc/cpuinfo lists them."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        assert linear._cpu_identity() == ([], "")
        return
    flags = re.search(r"^flags\s*:(.*)$", text, re.M)
    vendor = re.search(r"^vendor_id\s*:(.*)$", text, re.M)
    expected = (flags.group(1).split() if flags else [], vendor.group(1).strip() if vendor else "")
    assert linear._cpu_identity() == expected


def test_a_cpu_engine_in_bf16_keeps_kv_in_bf16_only_where_its_kernels_read_it():
    from kernels import CPU_OPS, REFERENCE_OPS

    assert model_runner.kv_dtype(torch.float32, torch.bfloat16, CPU_OPS) == torch.bfloat16
    assert model_runner.kv_dtype(torch.float32, torch.bfloat16, REFERENCE_OPS) == torch.float32  # no C kernels
    assert model_runner.kv_dtype(torch.float32, None, CPU_OPS) == torch.float32


def test_bfloat16_on_a_cpu_without_native_bf16_is_refused_with_what_to_use(monkeypatch):
    monkeypatch.setattr(model_runner, "onednn_packing", lambda dtype=torch.float32: dtype != torch.bfloat16)
    with pytest.raises(ValueError, match="use float32"):
        weight_dtypes(torch.bfloat16, torch.device("cpu"))


@native_bf16
def test_a_refined_head_keeps_float32s_argmax_and_leading_logits_where_bf16_ties_them():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 64, generator=gen) / 8
    x = torch.randn(8, 64, generator=gen)
    # per row, a runner-up 0.01 behind the first choice at a logit near 25 and ahead of it in
    # the vocabulary: bf16 rounds both alike, and argmax takes the first of a tie
    for i in range(8):
        w[2 * i] = x[i] * (24.99 / x[i].dot(x[i]))
        w[2 * i + 1] = x[i] * (25.0 / x[i].dot(x[i]))
    exact = x @ w.t()
    head = RefinedHead(w)
    got = head.float_out(x)
    assert Linear(w.bfloat16())(x).argmax(-1).tolist() != exact.argmax(-1).tolist()  # what it fixes
    assert got.argmax(-1).tolist() == exact.argmax(-1).tolist() == [2 * i + 1 for i in range(8)]
    top = exact.topk(8, dim=-1).indices  # well inside the 16 refined (the 16th may trade places)
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), atol=1e-4, rtol=1e-6)
    assert (got - exact).abs().max() <= 2 ** -7 * exact.abs().max()  # the tail: bf16's rounding


@pytest.mark.parametrize("vocab", [49152, 1000, 50257, 64])
def test_leading_finds_the_same_logits_as_topk(vocab):
    """The refined head's candidates: each row's k largest, bf16's ties included (any of equal
    values will do), for a vocabulary not a multiple of the block, and one smaller than k blocks."""
    from cluster.models.linear import leading

    gen = torch.Generator().manual_seed(vocab)
    for logits in (torch.randn(5, vocab, generator=gen) * 3 + 10,
                   (torch.randn(5, vocab, generator=gen) * 3 + 10).to(torch.bfloat16).float()):  # ties
        got = leading(logits, 16)
        assert got.shape == (5, 16) and all(len(set(row.tolist())) == 16 for row in got)
        want = logits.topk(16, dim=-1).values
        torch.testing.assert_close(logits.gather(1, got).sort(dim=-1, descending=True).values, want, atol=0, rtol=0)
