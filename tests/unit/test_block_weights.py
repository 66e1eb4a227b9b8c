"""Float32 weights that are exactly 4- or 8-bit blocks (a checkpoint converted from a quantized
GGUF, as the default model is) are kept as those blocks too, and a product of few rows reads
them: every weight comes back bit for bit, the product is float32's within summation-order
rounding, and any other weight stays float32 only."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess

import pytest
import torch

from cluster.models.linear import Linear, _cpu_identity
from kernels import CPU_OPS, cpu_paged_attention
from kernels.block_weights import MAX_ROWS_BESIDE_BF16, BlockWeight, pack_exact

pytestmark = pytest.mark.skipif(not cpu_paged_attention.available(), reason="no C compiler: no CPU kernels here")


def _extremes_in_every_block(q: torch.Tensor, low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    """Put `low` and `high` at random places of each block of 32, as a quantizer's min and max land."""
    where = torch.rand(q.shape, generator=gen).argsort(-1)[..., :2]
    q.scatter_(-1, where[..., :1], low)
    return q.scatter_(-1, where[..., 1:], high)


def q4_1(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """float32 [out, inp] dequantized from random Q4_1 blocks: d * q + m, d and m fp16."""
    gen = torch.Generator().manual_seed(seed)
    q = _extremes_in_every_block(torch.randint(0, 16, (out, inp // 32, 32), generator=gen), 0, 15, gen)
    d = (torch.rand(out, inp // 32, generator=gen) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(out, inp // 32, generator=gen) * 0.15).half().float()
    return (q.float() * d[..., None] + m[..., None]).reshape(out, inp)


def q8_0(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """float32 [out, inp] dequantized from random Q8_0 blocks: d * q, d fp16."""
    gen = torch.Generator().manual_seed(seed)
    q = _extremes_in_every_block(torch.randint(-127, 128, (out, inp // 32, 32), generator=gen), -127, 127, gen)
    d = (torch.rand(out, inp // 32, generator=gen) * 0.002 + 1e-4).half().float()
    return (q.float() * d[..., None]).reshape(out, inp)


@pytest.mark.parametrize("make, bits, bytes_a_weight", [(q4_1, 4, 0.75), (q8_0, 8, 1.125)])
def test_block_weights_come_back_bit_for_bit_in_fewer_bytes(make, bits, bytes_a_weight):
    w = make(96, 160)
    blocks = pack_exact(w)
    assert blocks is not None and blocks.bits == bits and blocks.shape == (96, 160)
    assert torch.equal(blocks.dequantize(), w)
    assert blocks.nbytes == 96 * 160 * bytes_a_weight


def test_weights_that_are_not_blocks_exactly_stay_float32_only():
    w = q4_1(64, 96)
    assert pack_exact(torch.randn(64, 96)) is None  # an ordinary float32 checkpoint
    one_ulp_off = w.clone()
    one_ulp_off[37, 50] = torch.nextafter(w[37, 50], torch.tensor(1.0))
    assert pack_exact(one_ulp_off) is None  # blocks everywhere but one weight: not kept
    for special in (float("inf"), float("nan")):
        broken = w.clone()
        broken[5, 70] = special
        assert pack_exact(broken) is None
    assert pack_exact(w.bfloat16()) is None  # a bf16 engine's projections
    assert pack_exact(torch.cat([w, w[:, :16]], 1)) is None  # `in` not a multiple of 32


@pytest.mark.parametrize("make", [q4_1, q8_0])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 40, 64, 65])
@pytest.mark.parametrize("out", [130, 131, 129])  # three weight rows at a time: 1, 2 and 0 left over
def test_a_product_through_the_blocks_is_float32s(make, rows, out, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    w = make(out, 192, seed=rows)
    bias = torch.randn(out, generator=gen)
    x = torch.randn(rows, 192, generator=gen)
    blocks = pack_exact(w)
    calls = []
    real = BlockWeight.matmul
    monkeypatch.setattr(BlockWeight, "matmul", lambda self, x: calls.append(x.shape[0]) or real(self, x))
    got = Linear(w, bias, blocks=blocks)(x)
    exact = (x.double() @ w.double().t() + bias.double()).float()
    assert got.shape == (rows, out) and got.dtype == torch.float32
    if rows:
        scale = (x.abs() @ w.abs().t()).max()
        assert (got - exact).abs().max() <= 1e-5 * scale  # fp32 rounding, summed in another order
    assert calls == ([rows] if rows <= blocks.max_rows else [])  # few rows read the blocks; more, oneDNN


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_beside_bf16_weights_one_streams_rows_read_the_blocks_in_float32_and_more_rows_bf16(x_dtype, monkeypatch):
    """A CPU engine in bf16 (oneDNN's bf16 kernel for few rows at half the blocks' speed): a
    product of up to MAX_ROWS_BESIDE_BF16 rows is float32's, from the blocks, in x's dtype; one
    of more rows is the bf16 weights' product, the blocks untouched."""
    w = q4_1(96, 192)
    blocks = pack_exact(w)
    calls = []
    real = BlockWeight.matmul
    monkeypatch.setattr(BlockWeight, "matmul", lambda self, x: calls.append(x.shape[0]) or real(self, x))
    bf16 = Linear(w.bfloat16(), blocks=blocks)
    for rows in range(1, MAX_ROWS_BESIDE_BF16 + 3):
        x = torch.randn(rows, 192, generator=torch.Generator().manual_seed(rows)).to(x_dtype)
        got = bf16(x)
        assert got.dtype == x_dtype and got.shape == (rows, 96)
        if rows <= MAX_ROWS_BESIDE_BF16:
            assert torch.equal(got, real(blocks, x.float()).to(x_dtype))  # the float32 Linear's product
            assert calls.pop() == rows
        else:
            exact = x.float() @ w.t()
            assert (got.float() - exact).abs().max() <= 2 ** -6 * (x.float().abs() @ w.abs().t()).max()  # bf16's
            assert not calls
    assert Linear(w, blocks=blocks).block_rows == blocks.max_rows > MAX_ROWS_BESIDE_BF16  # float32: as before


def test_a_refined_head_with_blocks_gives_one_streams_rows_float32s_logits():
    from cluster.models.linear import RefinedHead

    table = q8_0(1024, 64)  # a tied embedding that was Q8_0
    head = RefinedHead(table, blocks=pack_exact(table))
    plain = RefinedHead(table)
    gen = torch.Generator().manual_seed(3)
    for rows in (1, MAX_ROWS_BESIDE_BF16, MAX_ROWS_BESIDE_BF16 + 1, 16):
        x = torch.randn(rows, 64, generator=gen)
        got = head.float_out(x)
        if rows <= MAX_ROWS_BESIDE_BF16:  # every logit float32's, not only the leading ones
            assert torch.equal(got, pack_exact(table).matmul(x))
            assert (got - x @ table.t()).abs().max() <= 1e-5 * (x.abs() @ table.abs().t()).max()
        else:  # bf16 and the leading logits refined, as without blocks
            assert torch.equal(got, plain.float_out(x))


def test_a_strided_row_view_reads_the_same_as_its_copy():
    w = q4_1(64, 96)
    blocks = pack_exact(w)
    x = torch.randn(5, 200)[:, 7:103]  # rows 200 floats apart
    assert torch.equal(blocks.matmul(x), blocks.matmul(x.contiguous()))
    with pytest.raises(ValueError, match=r"float32 CPU tensor \[T, 96\]"):
        blocks.matmul(torch.randn(2, 64))


def test_the_default_model_is_loaded_with_its_gguf_blocks(default_model_path):
    """Its projections were Q4_1 and its tied embedding Q8_0 in the GGUF file it was converted
    from: each is found again from the float32 folder, the same bytes as the file's."""
    import gguf
    import numpy as np

    from cluster.models.architecture import Architecture
    from cluster.models.default_model import gguf_path
    from cluster.models.loader import load_model

    arch = Architecture.from_folder(default_model_path)
    model = load_model(default_model_path, arch, CPU_OPS, torch.float32, torch.device("cpu"), 256)
    layers = model.w.layers
    assert all(lin.blocks is not None and lin.blocks.bits == 4
               for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    head = model.w.lm_head.blocks
    assert head is not None and head.bits == 8 and head.shape == (arch.vocab_size, arch.hidden_size)
    assert torch.equal(head.dequantize(), model.w.embed)
    # in bf16 the same blocks beside the bf16 weights, for one stream's decode steps
    bf16 = load_model(default_model_path, arch, CPU_OPS, torch.float32, torch.device("cpu"), 256, torch.bfloat16)
    for ours, theirs in zip(bf16.w.layers, layers):
        for lin, f32 in zip((ours.qkv, ours.o, ours.gate_up, ours.down), (theirs.qkv, theirs.o, theirs.gate_up, theirs.down)):
            assert lin.dtype == torch.bfloat16 and torch.equal(lin.blocks.qs, f32.blocks.qs)
    assert torch.equal(bf16.w.lm_head.fast.blocks.dequantize(), model.w.embed)

    down = next(t for t in gguf.GGUFReader(gguf_path()).tensors if t.name == "blk.0.ffn_down.weight")
    assert down.tensor_type.name == "Q4_1"
    raw = np.asarray(down.data).reshape(-1, 20)  # a Q4_1 block: d, m (fp16), 16 bytes of nibbles
    ours = layers[0].down.blocks
    assert torch.equal(ours.d.reshape(-1), torch.from_numpy(raw[:, :2].copy().view(np.float16)).float().reshape(-1))
    assert torch.equal(ours.m.reshape(-1), torch.from_numpy(raw[:, 2:4].copy().view(np.float16)).float().reshape(-1))
    assert torch.equal(ours.qs.reshape(-1, 16), torch.from_numpy(raw[:, 4:].copy()))


BRANCHES = {  # the C file's branches other than the native build's, by the switches that pick them
    "portable": ["-mno-avx2", "-mno-fma", "-mno-f16c"],  # a CPU without AVX2 and FMA (an ARM host)
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mno-avx512f"],  # AVX2 where the host has AVX-512 too
}


@pytest.mark.parametrize("branch", sorted(BRANCHES))
def test_the_kernels_other_branches_give_the_same_products(branch, tmp_path):
    """Each of the C file's branches, built here with its switches, against the blocks the native
    build found (AVX-512's where the host has it)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the switches that pick a branch are x86's; elsewhere the native build is the portable one")
    if branch == "avx2" and not {"avx2", "fma", "f16c"} <= set(_cpu_identity()[0]):
        pytest.skip("the AVX2 branch needs a CPU with AVX2, FMA and F16C to run")
    lib_path = tmp_path / f"{branch}.so"
    source = cpu_paged_attention.SOURCE.with_name("cpu_block_matmul.c")
    subprocess.run([os.environ.get("CC", "cc"), "-O2", *BRANCHES[branch], "-shared", "-fPIC",
                    "-o", str(lib_path), str(source), "-lm"], check=True)
    lib = ctypes.CDLL(str(lib_path))
    lib.tandem_block_matmul.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_void_p]
    for make in (q4_1, q8_0):
        w = make(67, 96, seed=3)
        blocks = pack_exact(w)
        for rows in (1, 5, 8, 13):
            x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
            y = torch.empty(rows, 67)
            lib.tandem_block_matmul(blocks.bits, x.data_ptr(), rows, 96, blocks.qs.data_ptr(), blocks.d.data_ptr(),
                                    blocks.m.data_ptr(), 67, y.data_ptr())
            exact = (x.double() @ w.double().t()).float()
            assert (y - exact).abs().max() <= 1e-5 * (x.abs() @ w.abs().t()).max()
            assert torch.allclose(y, blocks.matmul(x), rtol=1e-5, atol=1e-5)
