"""The model's attention over the paged cache equals dense causal attention, on both decode paths."""

from __future__ import annotations

import pytest
import torch

from cluster.models.attention import (AttentionMetadata, PrefillChunk, cpu_decode_index, cpu_verify_index,
                                      paged_attention)
from kernels import CPU_OPS, REFERENCE_OPS

BS, HKV, HQ, D, NB = 4, 2, 6, 8, 40


def dense_causal(q, k, v, scale):
    """q [n, Hq, D] are the last n rows of k/v [ctx, Hkv, D]."""
    n, ctx = q.shape[0], k.shape[0]
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    scores = torch.einsum("nhd,chd->hnc", q, k) * scale
    allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hnc,chd->nhd", probs, v)


@pytest.mark.parametrize("cpu_index,verify,ops,D", [
    (False, False, REFERENCE_OPS, D), (True, False, REFERENCE_OPS, D), (True, True, REFERENCE_OPS, D),
    (False, False, CPU_OPS, 64),  # the C kernels (head size a multiple of 64, as they take it)
], ids=["kernels", "cpu decode index", "cpu verify batch", "cpu C kernels"])
def test_mixed_step_of_decodes_and_prefill_chunks_equals_dense_attention(cpu_index, verify, ops, D):
    """`verify`: the short chunks over a cached context (a token and its drafts: (6, 5), (11, 2))
    attend in one batched call (cpu_verify), not one call each."""
    gen = torch.Generator().manual_seed(3)
    # (cached tokens before this step, new tokens this step): two decodes, a fresh prompt,
    # and chunks continuing sequences whose first 6 and 11 tokens are cached
    seqs = [(9, 1), (2, 1), (0, 7), (6, 5), (11, 2)]
    perm = torch.randperm(NB, generator=gen).tolist()
    tables = [perm[i * 4:(i + 1) * 4] for i in range(len(seqs))]
    kv = torch.zeros(2, NB, BS, HKV, D)
    full_k = [torch.randn(c + n, HKV, D, generator=gen) for c, n in seqs]
    full_v = [torch.randn(c + n, HKV, D, generator=gen) for c, n in seqs]
    for (cached, _), table, k, v in zip(seqs, tables, full_k, full_v):  # earlier steps' KV
        for p in range(cached):
            kv[0, table[p // BS], p % BS], kv[1, table[p // BS], p % BS] = k[p], v[p]

    q_parts, k_parts, v_parts, slots, prefills, short = [], [], [], [], [], []
    offset = 0
    for (cached, new), table, k, v in zip(seqs, tables, full_k, full_v):
        q_parts.append(torch.randn(new, HQ, D, generator=gen))
        k_parts.append(k[cached:])
        v_parts.append(v[cached:])
        slots += [table[p // BS] * BS + p % BS for p in range(cached, cached + new)]
        if new > 1 and verify and cached:
            short.append((offset, new, cached + new, table[: -(-(cached + new) // BS)]))
        elif new > 1:
            prefills.append(PrefillChunk(offset, new, cached + new,
                                         torch.tensor(table[: -(-(cached + new) // BS)])))
        offset += new
    dec_tables = torch.tensor([tables[0], tables[1]], dtype=torch.int32)
    dec_lens = torch.tensor([10, 3], dtype=torch.int32)
    meta = AttentionMetadata(torch.tensor(slots), 2, dec_tables, dec_lens, tuple(prefills),
                             cpu_decode_index(dec_tables, dec_lens, BS, (HKV, D), kv.dtype) if cpu_index else None,
                             cpu_verify_index(short, BS, (HKV, D), kv.dtype, kv.device) if short else ())

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a replica runs: the C prefill kernel is taken only on one thread
    try:
        out = paged_attention(torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), kv, meta, ops, 0.3)
    finally:
        torch.set_num_threads(threads)
    expected = torch.cat([dense_causal(q, k, v, 0.3) for q, k, v in zip(q_parts, full_k, full_v)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # and the step's new K/V landed in their slots
    flat_k = kv[0].view(-1, HKV, D)
    torch.testing.assert_close(flat_k[torch.tensor(slots)], torch.cat(k_parts))


def test_cpu_decode_index_masks_positions_past_each_context():
    index = cpu_decode_index(torch.tensor([[3, 1], [2, 0]], dtype=torch.int32),
                             torch.tensor([6, 2], dtype=torch.int32), BS, (HKV, D), torch.float32)
    (group,) = index.groups  # 2 and 6 are close enough to share one padded gather
    by_row = {r: i for i, r in enumerate(group.rows.tolist())}
    assert group.slots[by_row[0]].tolist() == [12, 13, 14, 15, 4, 5]
    assert group.slots[by_row[1], :2].tolist() == [8, 9]
    assert group.valid[by_row[0], 0, 0].tolist() == [True] * 6
    assert group.valid[by_row[1], 0, 0].tolist() == [True, True] + [False] * 4


def test_cpu_decode_groups_split_long_contexts_from_short_ones():
    tables = torch.arange(4 * 160, dtype=torch.int32).view(4, 160)
    index = cpu_decode_index(tables, torch.tensor([600, 20, 30, 640], dtype=torch.int32), BS,
                             (HKV, D), torch.float32)
    assert [sorted(g.rows.tolist()) for g in index.groups] == [[1, 2], [0, 3]]
    assert [g.slots.shape[1] for g in index.groups] == [30, 640]  # the chats are not padded to 640
