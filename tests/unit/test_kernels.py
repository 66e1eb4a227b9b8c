"""Every Triton kernel against its torch reference (interpreter on CPU, native on CUDA)."""

from __future__ import annotations

import pytest
import torch

from kernels import (pack_kv, paged_decode_attention, ref_pack_kv, ref_paged_decode_attention,
                     ref_store_kv, ref_unpack_kv, store_kv, unpack_kv)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32] + ([torch.float16, torch.bfloat16] if DEVICE.type == "cuda" else [])


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


def _cache(num_blocks: int, block_size: int, heads: int, dim: int, dtype: torch.dtype,
           gen: torch.Generator) -> torch.Tensor:
    return torch.randn(num_blocks, block_size, heads, dim, generator=gen).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,block_size,heads,dim", [
    (1, 16, 1, 8), (7, 4, 2, 16), (23, 16, 3, 12), (40, 8, 4, 64),
])
def test_store_kv_matches_reference(dtype, num_tokens, block_size, heads, dim):
    gen = torch.Generator().manual_seed(num_tokens)
    num_blocks = 12
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[1::5] = -1  # padding tokens are skipped
    key = torch.randn(num_tokens, heads, dim, generator=gen).to(DEVICE, dtype)
    value = torch.randn(num_tokens, heads, dim, generator=gen).to(DEVICE, dtype)
    k_ref = _cache(num_blocks, block_size, heads, dim, dtype, gen)
    v_ref = _cache(num_blocks, block_size, heads, dim, dtype, gen)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()

    ref_store_kv(key, value, k_ref, v_ref, slots.to(DEVICE))
    store_kv(key, value, k_tri, v_tri, slots.to(DEVICE, torch.int32))
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)
    written = slots[slots >= 0].tolist()
    assert written, "the case must write something"
    flat = k_tri.view(-1, heads, dim)
    assert torch.equal(flat[written[0]], key[slots.tolist().index(written[0])])


def test_store_kv_accepts_strided_key_views():
    """The model passes k/v as views into a fused qkv projection: rows are strided."""
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 3, 2, 8, generator=gen).to(DEVICE)
    key, value = qkv[:, 1], qkv[:, 2]
    k_ref = torch.zeros(4, 4, 2, 8, device=DEVICE)
    v_ref = torch.zeros_like(k_ref)
    k_tri, v_tri = k_ref.clone(), v_ref.clone()
    slots = torch.tensor([3, 0, 9, 15, 6], device=DEVICE)
    ref_store_kv(key, value, k_ref, v_ref, slots)
    store_kv(key, value, k_tri, v_tri, slots)
    assert torch.equal(k_tri, k_ref) and torch.equal(v_tri, v_ref)


@pytest.mark.parametrize("split_tokens", [512, 12])  # one split; several, some empty
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,q_heads,kv_heads,dim,block_size", [
    (1, 1, 1, 8, 16),  # MHA, one block
    (3, 4, 2, 16, 4),  # GQA group 2, many small blocks
    (4, 9, 3, 64, 16),  # SmolLM2-like group 3
    (2, 8, 1, 32, 8),  # MQA
])
def test_paged_decode_attention_matches_reference(dtype, batch, q_heads, kv_heads, dim, block_size,
                                                  split_tokens):
    gen = torch.Generator().manual_seed(batch * 100 + q_heads)
    num_blocks = 20
    k_cache = _cache(num_blocks, block_size, kv_heads, dim, dtype, gen)
    v_cache = _cache(num_blocks, block_size, kv_heads, dim, dtype, gen)
    lens = torch.randint(1, 5 * block_size, (batch,), generator=gen)
    lens[0] = 1  # a sequence with just the new token
    max_blocks = int(-(-lens.max() // block_size)) + 1  # one padding column
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:max_blocks] for _ in range(batch)])
    query = torch.randn(batch, q_heads, dim, generator=gen).to(DEVICE, dtype)
    scale = dim ** -0.5
    args = (k_cache, v_cache, tables.to(DEVICE, torch.int32), lens.to(DEVICE, torch.int32), scale)

    expected = ref_paged_decode_attention(query, *args)
    actual = paged_decode_attention(query, *args, split_tokens=split_tokens)
    torch.testing.assert_close(actual, expected, **_tol(dtype))


def test_paged_decode_reference_equals_dense_attention():
    """The reference itself: paged lookup + GQA equals plain attention over the gathered rows."""
    gen = torch.Generator().manual_seed(1)
    block_size, kv_heads, q_heads, dim, length = 4, 2, 6, 8, 11
    k_cache = torch.randn(6, block_size, kv_heads, dim, generator=gen)
    v_cache = torch.randn(6, block_size, kv_heads, dim, generator=gen)
    table = torch.tensor([[5, 0, 3]])
    query = torch.randn(1, q_heads, dim, generator=gen)
    out = ref_paged_decode_attention(query, k_cache, v_cache, table.int(), torch.tensor([length]).int(), 0.3)
    keys = k_cache[table[0]].flatten(0, 1)[:length].repeat_interleave(3, dim=1)  # [L, Hq, D]
    values = v_cache[table[0]].flatten(0, 1)[:length].repeat_interleave(3, dim=1)
    probs = torch.softmax(torch.einsum("hd,lhd->hl", query[0], keys) * 0.3, dim=-1)
    torch.testing.assert_close(out[0], torch.einsum("hl,lhd->hd", probs, values))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers,num_blocks,block_size,heads,dim,picked", [
    (1, 4, 16, 1, 8, [2]),
    (2, 10, 4, 2, 16, [7, 0, 3]),
    (3, 16, 16, 3, 64, [15, 1, 8, 9, 4]),
])
def test_pack_and_unpack_match_reference(dtype, layers, num_blocks, block_size, heads, dim, picked):
    gen = torch.Generator().manual_seed(num_blocks)
    cache = torch.randn(layers, 2, num_blocks, block_size, heads, dim, generator=gen).to(DEVICE, dtype)
    ids = torch.tensor(picked, device=DEVICE)

    packed = pack_kv(cache, ids)
    assert packed.shape == (layers, 2, len(picked), block_size, heads, dim)
    assert torch.equal(packed, ref_pack_kv(cache, ids))
    assert torch.equal(pack_kv(cache, picked), packed)  # a plain list works too

    # scatter into other blocks of a second cache: same as the reference, rest untouched
    free = [b for b in range(num_blocks) if b not in picked][: len(picked)]
    if len(free) < len(picked):
        free = list(reversed(picked))
    target_ref = torch.zeros_like(cache)
    target_tri = torch.zeros_like(cache)
    ref_unpack_kv(packed, target_ref, free)
    unpack_kv(packed, target_tri, free)
    assert torch.equal(target_tri, target_ref)
    assert torch.equal(pack_kv(target_tri, free), packed)


def test_launchers_reject_bad_arguments_by_name():
    cache = torch.zeros(2, 4, 2, 8, device=DEVICE)
    key = torch.zeros(3, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, key, cache, cache.clone(), torch.zeros(2, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="key has dtype"):
        store_kv(key.double(), key.double(), cache, cache.clone(), torch.zeros(3, dtype=torch.int64, device=DEVICE))
    q = torch.zeros(2, 3, 8, device=DEVICE)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_decode_attention(q, cache, cache.clone(), torch.zeros(2, 1, dtype=torch.int32, device=DEVICE),
                               torch.ones(2, dtype=torch.int32, device=DEVICE), 1.0)
    with pytest.raises(TypeError, match="block_tables"):
        paged_decode_attention(q[:, :2], cache, cache.clone(), torch.zeros(2, 1, dtype=torch.int64, device=DEVICE),
                               torch.ones(2, dtype=torch.int32, device=DEVICE), 1.0)
    kv = torch.zeros(1, 2, 4, 2, 2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="packed must be"):
        unpack_kv(torch.zeros(1, 2, 3, 2, 2, 8, device=DEVICE), kv, [0, 1])
    with pytest.raises(ValueError, match="kv_cache must be"):
        pack_kv(cache, [0])
