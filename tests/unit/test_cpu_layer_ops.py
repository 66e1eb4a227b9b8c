"""A layer's element-wise steps in C (kernels/cpu_layer_ops.py) against the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cluster.models.rope import RotaryEmbedding
from kernels import ref_store_kv
from kernels.cpu_layer_ops import cpu_add_rms_norm, cpu_rope_, cpu_silu_mul, cpu_store_kv


@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 576), (3, 40)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_torch_and_updates_the_residual(rows, hidden, with_delta):
    gen = torch.Generator().manual_seed(rows)
    x, delta = (torch.randn(rows, hidden, generator=gen) for _ in range(2))
    w = torch.rand(hidden, generator=gen)
    residual = x + delta if with_delta else x.clone()
    want = F.rms_norm(residual, (hidden,), w, 1e-5)
    got_x, got = cpu_add_rms_norm(x, delta if with_delta else None, w, 1e-5)
    assert got_x is x  # the running residual is updated in place
    torch.testing.assert_close(x, residual)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("delta_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_takes_a_bf16_projections_output_and_gives_its_next_input(delta_dtype):
    """A bf16 engine: the delta comes out of a bf16 projection, the norm goes into one. Both
    as torch's casts around the fp32 ops: the residual exact, the norm rounded once."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(9, 576, generator=gen)
    delta = torch.randn(9, 576, generator=gen).to(delta_dtype)
    w = torch.rand(576, generator=gen)
    residual = x + delta.float()
    want = F.rms_norm(residual, (576,), w, 1e-5)
    _, got = cpu_add_rms_norm(x, delta, w, 1e-5, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(x, residual)
    torch.testing.assert_close(got.float(), want, atol=0, rtol=2 ** -8)  # within one bf16 rounding


def test_silu_mul_is_torchs_silu_times_up_rounded_once_to_bf16():
    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(33, 2 * 1536, generator=gen) * 4).to(torch.bfloat16)
    gate, up = gate_up.float().chunk(2, dim=-1)
    want = (F.silu(gate) * up).to(torch.bfloat16)
    got = cpu_silu_mul(gate_up)
    assert got.dtype == torch.bfloat16 and got.shape == (33, 1536)
    # the same rounding but for the rare value within an fp32 ulp of a bf16 tie (exp differs by an ulp)
    assert (got != want).float().mean() < 1e-3
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -7)
    with pytest.raises(TypeError, match="bfloat16"):
        cpu_silu_mul(gate_up.float())


def test_add_rms_norm_refuses_what_it_cannot_update_in_place():
    x = torch.randn(4, 8).t()  # not contiguous
    with pytest.raises(ValueError, match="contiguous"):
        cpu_add_rms_norm(x, None, torch.ones(4), 1e-5)
    with pytest.raises(TypeError, match="float32"):
        cpu_add_rms_norm(torch.randn(2, 8).double(), None, torch.ones(8), 1e-5)


def test_rope_in_place_matches_the_copy_on_a_fused_projections_view():
    """q and k heads rotated inside the qkv output, v untouched, as the model calls it."""
    heads, kv_heads, dim, tokens = 9, 3, 64, 5
    rope = RotaryEmbedding(dim, 4096, 10000.0, {}, torch.device("cpu"), torch.float32)
    cos, sin = rope.lookup(torch.tensor([0, 1, 17, 900, 4095]))
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim)
    want = rope.apply(qkv[:, : heads + kv_heads], cos, sin)
    v_before = qkv[:, heads + kv_heads:].clone()
    got = cpu_rope_(qkv[:, : heads + kv_heads], cos, sin)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(qkv[:, : heads + kv_heads], want, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, heads + kv_heads:], v_before)


def test_store_kv_matches_the_reference_skips_negative_slots_and_refuses_slots_past_the_cache():
    tokens, kv_heads, dim, blocks, block_size = 6, 3, 64, 8, 16
    qkv = torch.randn(tokens, 9 + 2 * kv_heads, dim)
    key, value = qkv[:, 9: 9 + kv_heads], qkv[:, 9 + kv_heads:]  # strided views, as the model passes them
    slots = torch.tensor([5, 127, -1, 16, 0, 64])
    caches = [torch.randn(blocks, block_size, kv_heads, dim, generator=torch.Generator().manual_seed(1))
              for _ in range(4)]
    cpu_store_kv(key, value, caches[0], caches[1], slots)
    ref_store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    before = caches[0].clone()
    with pytest.raises(ValueError, match="past the cache"):
        cpu_store_kv(key[:1], value[:1], caches[0], caches[1], torch.tensor([blocks * block_size]))
    assert torch.equal(caches[0], before)  # nothing written outside, nothing inside either


def test_store_kv_into_bfloat16_caches_rounds_as_torch_does():
    """Round to nearest even, ties included, as `.to(torch.bfloat16)` (ref_store_kv)."""
    gen = torch.Generator().manual_seed(2)
    key, value = torch.randn(5, 3, 64, generator=gen), torch.randn(5, 3, 64, generator=gen)
    key[0, 0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 3e38])  # ties, and near the top
    slots = torch.tensor([3, 0, 17, -1, 31])
    caches = [torch.zeros(2, 16, 3, 64, dtype=torch.bfloat16) for _ in range(4)]
    cpu_store_kv(key, value, caches[0], caches[1], slots)
    ref_store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0].view(torch.int16), caches[2].view(torch.int16))
    assert torch.equal(caches[1].view(torch.int16), caches[3].view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_in_one_call_is_rope_store_and_paged_decode_one_by_one(dtype):
    """A decode-only step's attention, as the model calls it for each layer: the same cache
    contents and the same output as the three calls it replaces (in the dtype qkv comes in)."""
    from kernels.cpu_layer_ops import cpu_decode_attention
    from kernels.cpu_paged_attention import cpu_paged_decode_attention

    heads, kv_heads, dim, block_size, blocks = 9, 3, 64, 16, 12
    gen = torch.Generator().manual_seed(5)
    lens = torch.tensor([1, 17, 40], dtype=torch.int32)  # a first token, one past a block, a longer one
    tables = torch.tensor([[0, 0, 0], [3, 5, 0], [7, 2, 9]], dtype=torch.int32)
    slots = torch.tensor([0 * 16 + 0, 5 * 16 + 0, 9 * 16 + 7])  # each row's new position
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    rope = RotaryEmbedding(dim, 4096, 10000.0, {}, torch.device("cpu"), torch.float32)
    cos, sin = rope.lookup((lens - 1).long())
    caches = [torch.randn(blocks, block_size, kv_heads, dim, generator=gen).to(dtype) for _ in range(2)]
    k_want, v_want = (c.clone() for c in caches)

    x = qkv.float().clone().view(3, heads + 2 * kv_heads, dim)  # rotated in place below
    qk = cpu_rope_(x[:, : heads + kv_heads], cos, sin)
    cpu_store_kv(qk[:, heads:], x[:, heads + kv_heads:], k_want, v_want, slots)
    want = cpu_paged_decode_attention(qk[:, :heads].contiguous(), k_want, v_want, tables, lens, 0.125)

    got = cpu_decode_attention(qkv, cos, sin, caches[0], caches[1], slots, tables, lens, heads, 0.125)
    assert got.dtype == dtype and got.shape == (3, heads * dim)
    assert torch.equal(caches[0], k_want) and torch.equal(caches[1], v_want)
    assert torch.equal(got, want.reshape(3, -1).to(dtype))
    with pytest.raises(ValueError, match="past the cache"):
        cpu_decode_attention(qkv, cos, sin, *caches, slots + blocks * block_size, tables, lens, heads, 0.125)
    with pytest.raises(ValueError, match="context_lens"):
        cpu_decode_attention(qkv, cos, sin, *caches, slots, tables, lens * 0, heads, 0.125)
