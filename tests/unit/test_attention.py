"""The model's attention over the paged cache equals dense causal attention, on both decode paths."""

from __future__ import annotations

import pytest
import torch

from cluster.models.attention import (AttentionMetadata, DecodeMirrors, PrefillChunk, cpu_decode_index,
                                      cpu_verify_index, paged_attention)
from kernels import REFERENCE_OPS

BS, HKV, HQ, D, NB = 4, 2, 6, 8, 40


def dense_causal(q, k, v, scale):
    """q [n, Hq, D] are the last n rows of k/v [ctx, Hkv, D]."""
    n, ctx = q.shape[0], k.shape[0]
    k, v = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)
    scores = torch.einsum("nhd,chd->hnc", q, k) * scale
    allowed = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hnc,chd->nhd", probs, v)


@pytest.mark.parametrize("cpu_index,verify", [(False, False), (True, False), (True, True)],
                         ids=["kernels", "cpu decode index", "cpu verify batch"])
def test_mixed_step_of_decodes_and_prefill_chunks_equals_dense_attention(cpu_index, verify):
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

    out = paged_attention(torch.cat(q_parts), torch.cat(k_parts), torch.cat(v_parts), kv, meta,
                          REFERENCE_OPS, 0.3)
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


def test_decode_steps_with_mirrors_equal_dense_attention_as_sequences_join_leave_and_jump():
    """Kept rows (DecodeMirrors) across decode steps give what gathering afresh gives, and dense
    attention: while the same sequences each move one token on (appended in place), after one
    joins or leaves (that group gathers again), and after one moves on by more than a token
    (drafts accepted in a verify step: gathered again, never the stale rows)."""
    gen = torch.Generator().manual_seed(5)
    kv = torch.zeros(2, NB, BS, HKV, D)
    layer_key = kv[0].data_ptr()
    mirrors = DecodeMirrors([layer_key], (HKV, D), kv.dtype, max_bytes=1 << 20, slack=3)
    perm = torch.randperm(NB, generator=gen).tolist()
    tables = {rid: perm[i * 8:(i + 1) * 8] for i, rid in enumerate("abcd")}
    keys = {rid: torch.randn(32, HKV, D, generator=gen) for rid in "abcd"}
    values = {rid: torch.randn(32, HKV, D, generator=gen) for rid in "abcd"}
    # the context length of each decoding sequence, step by step
    steps = [{"a": 5, "b": 9}, {"a": 6, "b": 10}, {"a": 7, "b": 11}, {"a": 8, "b": 12, "c": 3},
             {"a": 9, "b": 13, "c": 4}, {"b": 14, "c": 5}, {"b": 17, "c": 6}, {"b": 18, "c": 7},
             {"b": 19, "c": 8}, {"b": 20, "c": 9}, {"b": 21, "c": 10}]
    fills = []
    for lens in steps:
        rids = list(lens)
        for rid in rids:  # every position up to the new token is in the cache, as the model's store does
            for p in range(lens[rid]):
                t = tables[rid]
                kv[0, t[p // BS], p % BS], kv[1, t[p // BS], p % BS] = keys[rid][p], values[rid][p]
        q = torch.randn(len(rids), HQ, D, generator=gen)
        k_new = torch.stack([keys[r][lens[r] - 1] for r in rids])
        v_new = torch.stack([values[r][lens[r] - 1] for r in rids])
        width = max(-(-lens[r] // BS) for r in rids)
        dec_tables = torch.tensor([tables[r][:width] for r in rids], dtype=torch.int32)
        dec_lens = torch.tensor([lens[r] for r in rids], dtype=torch.int32)
        slots = torch.tensor([tables[r][(lens[r] - 1) // BS] * BS + (lens[r] - 1) % BS for r in rids])
        index = cpu_decode_index(dec_tables, dec_lens, BS, (HKV, D), kv.dtype, rids, mirrors)
        fills.append([g.fill for g in index.groups])
        meta = AttentionMetadata(slots, len(rids), dec_tables, dec_lens, (), index)
        out = paged_attention(q, k_new, v_new, kv, meta, REFERENCE_OPS, 0.4)
        fresh = AttentionMetadata(slots, len(rids), dec_tables, dec_lens, (),
                                  cpu_decode_index(dec_tables, dec_lens, BS, (HKV, D), kv.dtype))
        torch.testing.assert_close(out, paged_attention(q, k_new, v_new, kv, fresh, REFERENCE_OPS, 0.4),
                                   atol=0, rtol=0)
        expected = torch.cat([dense_causal(q[i:i + 1], keys[r][:lens[r]], values[r][:lens[r]], 0.4)
                              for i, r in enumerate(rids)])
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # gathered: the first step, c joining, a leaving, b jumping 3 tokens, b outgrowing the slack
    assert fills == [[True], [False], [False], [True], [False], [True], [True], [False], [False], [False], [True]]


def test_mirrors_past_their_memory_bound_fall_back_to_gathering():
    kv = torch.zeros(2, NB, BS, HKV, D)
    row_bytes = HKV * D * 4
    mirrors = DecodeMirrors([kv[0].data_ptr()], (HKV, D), kv.dtype, max_bytes=2 * 2 * 10 * row_bytes, slack=2)
    tables = torch.arange(2 * 8, dtype=torch.int32).view(2, 8)
    small = cpu_decode_index(tables[:1], torch.tensor([8], dtype=torch.int32), BS, (HKV, D), kv.dtype, ["x"], mirrors)
    assert small.groups[0].mirror is not None  # 2 x 1 row x 10 positions: within the bound
    both = cpu_decode_index(tables, torch.tensor([9, 9], dtype=torch.int32), BS, (HKV, D), kv.dtype,
                            ["x", "y"], mirrors)
    assert both.groups[0].mirror is None and both.groups[0].gathered.numel() > 0
