"""The C attention kernels (kernels/cpu_paged_attention.py) against torch references, and the
engine's choice of them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import AMX_CPU_OPS, AVX2_CPU_OPS, CPU_OPS, REFERENCE_OPS, cpu_paged_attention, ops_for, ref_paged_decode_attention
from kernels.cpu_paged_attention import amx_prefill_attention, cpu_paged_decode_attention, cpu_prefill_attention


def _case(batch, q_heads, kv_heads, dim, block_size, lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // block_size)
    num_blocks = batch * width + 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen)
    # blocks scattered over the cache, as a long-running engine leaves them; unused entries of a
    # short sequence's row point at a block the reference would also ignore
    tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width).to(torch.int32)
    query = torch.randn(batch, q_heads, dim, generator=gen)
    return query, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("batch,q_heads,kv_heads,dim,block_size,lens", [
    (1, 1, 1, 8, 4, [1]),  # one token of context
    (3, 9, 3, 64, 16, [16, 17, 250]),  # the default model's heads; a block boundary; a long one
    (4, 4, 4, 32, 8, [5, 40, 8, 1]),  # no GQA
    (2, 8, 1, 48, 16, [33, 700]),  # multi-query, a head size that is not a power of two
    (16, 9, 3, 64, 16, [150 + 9 * i for i in range(16)]),  # 16 chats, as bench/serve.py's load
])
def test_cpu_decode_kernel_matches_reference(batch, q_heads, kv_heads, dim, block_size, lens):
    query, k_cache, v_cache, tables, context_lens = _case(batch, q_heads, kv_heads, dim, block_size, lens)
    got = cpu_paged_decode_attention(query, k_cache, v_cache, tables, context_lens, 0.3)
    want = ref_paged_decode_attention(query, k_cache, v_cache, tables, context_lens, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lens", [[1], [16, 17, 250], [150 + 9 * i for i in range(16)]])
def test_cpu_decode_kernel_over_bfloat16_caches_matches_the_reference_over_their_values(lens):
    """A bf16 engine's caches: read as the fp32 values they hold, arithmetic in fp32."""
    query, k_cache, v_cache, tables, context_lens = _case(len(lens), 9, 3, 64, 16, lens)
    k_half, v_half = k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)
    got = cpu_paged_decode_attention(query, k_half, v_half, tables, context_lens, 0.125)
    want = ref_paged_decode_attention(query, k_half.float(), v_half.float(), tables, context_lens, 0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cpu_decode_kernel_reads_only_each_sequences_context():
    """Cache rows past a sequence's length (stale tokens of a freed request) must not leak in."""
    query, k_cache, v_cache, tables, lens = _case(2, 9, 3, 64, 16, [20, 9])
    before = cpu_paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    for b, n in enumerate(lens.tolist()):  # poison every slot after the last valid position
        for pos in range(n, tables.shape[1] * 16):
            block, off = int(tables[b, pos // 16]), pos % 16
            k_cache[block, off] = 1e4
            v_cache[block, off] = float("nan")
    after = cpu_paged_decode_attention(query, k_cache, v_cache, tables, lens, 0.125)
    assert torch.equal(before, after)


def test_cpu_decode_kernel_rejects_bad_arguments():
    query, k_cache, v_cache, tables, lens = _case(2, 9, 3, 64, 16, [20, 9])
    with pytest.raises(TypeError, match="float32"):
        cpu_paged_decode_attention(query.double(), k_cache, v_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="context_lens"):
        cpu_paged_decode_attention(query, k_cache, v_cache, tables, torch.tensor([0, 9], dtype=torch.int32), 0.1)
    with pytest.raises(ValueError, match="context_lens"):
        cpu_paged_decode_attention(query, k_cache, v_cache, tables, torch.tensor([20, 10_000], dtype=torch.int32),
                                   0.1)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_paged_decode_attention(query[:, :, :32], k_cache, v_cache, tables, lens, 0.1)


def _dense_causal(q, k, v, scale):
    """q [n, Hq, D] are the last n of ctx positions in k/v [ctx, Hkv, D]: plain softmax(QK^T)V."""
    n, ctx, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    seen = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("n,ctx,q_heads,kv_heads,dim", [
    (1, 1, 1, 1, 64),  # one token
    (512, 512, 9, 3, 64),  # the default model's first chunk of a long prompt
    (488, 1000, 9, 3, 64),  # ... and its second, over the cached first
    (37, 37, 9, 3, 64),  # not a multiple of the 8-query tile nor the 64-key tile
    (5, 300, 8, 1, 128),  # a short chunk after a long prefix; multi-query, D 128
    (70, 129, 4, 4, 64),  # no GQA; one key past two tiles
])
def test_cpu_prefill_kernel_matches_dense_causal_attention(n, ctx, q_heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(n + ctx)
    q = torch.randn(n, q_heads, dim, generator=gen)
    k, v = (torch.randn(ctx, kv_heads, dim, generator=gen) for _ in range(2))
    torch.testing.assert_close(cpu_prefill_attention(q, k, v, 0.125), _dense_causal(q, k, v, 0.125),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n,ctx", [(512, 512), (488, 1000), (37, 37), (1, 1), (70, 129)])
def test_cpu_prefill_kernel_in_bf16_products_is_dense_attention_within_bf16_rounding(n, ctx):
    """A bf16 engine's prefill: K/V already bf16 values, Q and the probabilities rounded to bf16
    for the products (on a CPU without AVX512-BF16, the fp32 kernel: closer still)."""
    gen = torch.Generator().manual_seed(n + ctx)
    q = torch.randn(n, 9, 64, generator=gen)
    k, v = (torch.randn(ctx, 3, 64, generator=gen).bfloat16().float() for _ in range(2))
    want = _dense_causal(q, k, v, 0.125)
    got = cpu_prefill_attention(q, k, v, 0.125, torch.bfloat16)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert (got - want).abs().mean() < 2e-3  # the rounding of two bf16 operands, not an error in the sums
    d128 = torch.randn(4, 2, 128, generator=gen)  # D 128: the fp32 kernel
    assert torch.equal(cpu_prefill_attention(d128, d128, d128, 0.1, torch.bfloat16),
                       cpu_prefill_attention(d128, d128, d128, 0.1))


def test_cpu_prefill_kernel_reads_strided_rows_of_a_fused_projection():
    """The model hands it q/k/v as views into one [T, Hq + 2 Hkv, D] qkv tensor."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(50, 9 + 2 * 3, 64, generator=gen)
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    assert not q.is_contiguous() and not k.is_contiguous()
    torch.testing.assert_close(cpu_prefill_attention(q, k, v, 0.2), _dense_causal(q, k, v, 0.2),
                               atol=2e-5, rtol=2e-5)


def test_cpu_prefill_kernel_rejects_bad_arguments():
    q, k = torch.randn(4, 9, 64), torch.randn(6, 3, 64)
    with pytest.raises(TypeError, match="float32"):
        cpu_prefill_attention(q.bfloat16(), k, k, 0.1)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_prefill_attention(q, k[:3], k[:3], 0.1)  # more queries than context
    with pytest.raises(ValueError, match="does not fit"):
        cpu_prefill_attention(q[..., :48], k[..., :48], k[..., :48], 0.1)  # D not a multiple of 64


@pytest.mark.parametrize("n,ctx", [(512, 512), (488, 1000), (37, 37), (1, 1), (70, 129), (5, 300)])
def test_amx_prefill_in_bf16_products_is_dense_attention_within_bf16_rounding(n, ctx):
    """torch's fused SDPA in bf16 (a CPU with AMX runs it as tile instructions; elsewhere it is
    only slower): the same contract and bounds as the C kernel's bf16 products."""
    gen = torch.Generator().manual_seed(n + ctx)
    q = torch.randn(n, 9, 64, generator=gen)
    k, v = (torch.randn(ctx, 3, 64, generator=gen).bfloat16().float() for _ in range(2))
    want = _dense_causal(q, k, v, 0.125)
    got = amx_prefill_attention(q, k, v, 0.125, torch.bfloat16)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert (got - want).abs().mean() < 2e-3
    # a prompt's rows come out the same whether it is prefilled whole or in two chunks
    if n == ctx and n > 64:
        second = amx_prefill_attention(q[64:], k, v, 0.125, torch.bfloat16)
        torch.testing.assert_close(second, got[64:], atol=1e-2, rtol=0)


def test_amx_prefill_keeps_the_c_kernel_for_float32_products_and_checks_shapes():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(40, 9, 64, generator=gen)
    k, v = (torch.randn(60, 3, 64, generator=gen) for _ in range(2))
    assert torch.equal(amx_prefill_attention(q, k, v, 0.1), cpu_prefill_attention(q, k, v, 0.1))
    with pytest.raises(ValueError, match="does not fit"):
        amx_prefill_attention(q, k[:3], v[:3], 0.1, torch.bfloat16)  # more queries than context
    with pytest.raises(ValueError, match="does not fit"):
        amx_prefill_attention(q, k, v[:, :, :32], 0.1, torch.bfloat16)


def test_engine_uses_the_kernel_on_cpu_float32_and_the_torch_path_otherwise(monkeypatch):
    monkeypatch.setattr(cpu_paged_attention, "amx_bf16", lambda: False)
    monkeypatch.setattr(cpu_paged_attention, "avx512", lambda: True)
    assert ops_for(torch.device("cpu"), torch.float32) is CPU_OPS
    assert CPU_OPS.prefill_attention is cpu_prefill_attention and REFERENCE_OPS.prefill_attention is None
    monkeypatch.setattr(cpu_paged_attention, "amx_bf16", lambda: True)  # the one difference on an AMX CPU
    assert ops_for(torch.device("cpu"), torch.float32) is AMX_CPU_OPS
    assert AMX_CPU_OPS == CPU_OPS._replace(prefill_attention=amx_prefill_attention)
    # without AVX-512: the C decode kernels, prefill attention on the engine's SDPA path
    monkeypatch.setattr(cpu_paged_attention, "amx_bf16", lambda: False)
    monkeypatch.setattr(cpu_paged_attention, "avx512", lambda: False)
    assert ops_for(torch.device("cpu"), torch.float32) is AVX2_CPU_OPS
    assert AVX2_CPU_OPS == CPU_OPS._replace(prefill_attention=None)
    monkeypatch.undo()
    assert ops_for(torch.device("cpu"), torch.bfloat16) is REFERENCE_OPS
    # TANDEM_CPU_KERNELS=0 turns it off (A/B benches): a fresh process sees the torch path
    code = ("import torch; from kernels import ops_for, REFERENCE_OPS; "
            "assert ops_for(torch.device('cpu')) is REFERENCE_OPS")
    env = {**os.environ, "TANDEM_CPU_KERNELS": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
