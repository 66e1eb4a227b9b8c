"""Drafts inside continuous batching (engine/spec/speculator.py with the scheduler and block
manager, torch-free): what a step reserves for drafts, what it keeps, and what it gives back."""

from __future__ import annotations

from builders import ScriptedProposer, make_request, make_scheduler, make_speculator, run_step

from cluster.engine.request import RequestStatus


def decoding(sched, prompt_len=7, **params):
    """A request past its prefill, its next token known (a 1-token decode chunk next)."""
    req = make_request(prompt_len=prompt_len, **params)
    sched.add(req)
    run_step(sched, token=50)
    return req


def test_rejected_drafts_give_their_blocks_back_and_only_accepted_blocks_are_cached():
    sched = make_scheduler(num_blocks=16, block_size=4)
    spec = make_speculator(sched, k=6)
    req = decoding(sched, max_tokens=32)  # 7 prompt tokens + 1 output: 2 blocks
    free_before = sched.blocks.num_free_blocks
    plan = spec.draft(sched.schedule())
    (chunk,) = plan.chunks
    assert chunk.num_drafts == 6 and chunk.num_tokens == 7
    assert len(req.block_ids) == 4  # positions 7..13 need blocks up to #3
    sched.update(plan, {req.request_id: [60]})  # the first draft (51) rejected: 60 instead
    spec.observe(plan, {req.request_id: [60]})
    assert req.output_token_ids == [50, 60] and req.num_computed_tokens == 8
    assert len(req.block_ids) == 2 and sched.blocks.num_free_blocks == free_before
    assert len(sched.blocks.cached) == 2  # blocks of tokens 0..7: both full of computed tokens
    assert spec.counters["spec_num_draft_tokens"] == 6 and spec.counters["spec_num_accepted_tokens"] == 0

    plan = spec.draft(sched.schedule())
    accepted = list(plan.chunks[0].draft_token_ids[:5])  # 5 of 6 accepted, then a token of its own
    sched.update(plan, {req.request_id: [*accepted, 99]})
    spec.observe(plan, {req.request_id: [*accepted, 99]})
    assert req.output_token_ids == [50, 60, *accepted, 99]
    assert req.num_computed_tokens == 14  # through the 5 accepted drafts; 99's KV comes next step
    assert len(req.block_ids) == 4 and len(sched.blocks.cached) == 3  # tokens 12, 13: not yet a full block
    assert spec.accepted_per_pos[:6] == [1, 1, 1, 1, 1, 0]


def test_drafts_never_preempt_and_fit_the_step_budget():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=6)
    spec = make_speculator(sched, k=8)
    a = decoding(sched, prompt_len=7)  # 2 blocks
    b = decoding(sched, prompt_len=7)  # 2 blocks: none free now
    plan = spec.draft(sched.schedule())
    assert [c.num_drafts for c in plan.chunks] == [0, 0] and not plan.preempted
    sched.abort(b.request_id)
    plan = spec.draft(sched.schedule())
    (chunk,) = plan.chunks
    assert chunk.request is a and chunk.num_tokens == 6  # budget 6: 1 token + 5 drafts, not 8


def test_max_tokens_and_max_model_len_bound_the_drafts():
    sched = make_scheduler(num_blocks=16, block_size=4)
    spec = make_speculator(sched, k=8)
    req = decoding(sched, max_tokens=4)  # one output so far: 3 more may come, so at most 2 drafts
    plan = spec.draft(sched.schedule())
    assert plan.chunks[0].num_drafts == 2
    sched.update(plan, {req.request_id: [*plan.chunks[0].draft_token_ids, 7]})
    assert req.status == RequestStatus.FINISHED_LENGTH and req.num_output_tokens == 4
    assert sched.blocks.num_free_blocks == 16


def test_a_stop_token_inside_an_accepted_run_ends_the_reply_there():
    sched = make_scheduler(num_blocks=16, block_size=4)
    spec = make_speculator(sched, k=4)
    req = decoding(sched, stop_token_ids=[52])
    plan = spec.draft(sched.schedule())
    drafts = list(plan.chunks[0].draft_token_ids)
    assert drafts == [51, 52, 53, 54]
    sched.update(plan, {req.request_id: [51, 52, 53, 54, 55]})  # all accepted by the model
    assert req.output_token_ids == [50, 51, 52] and req.status == RequestStatus.FINISHED_STOPPED
    assert req.stop_reason == 52 and sched.blocks.num_free_blocks == 16


def test_a_request_never_seen_by_the_proposer_drafts_from_its_token_ids():
    """What a migrated stream or a prompt prefilled elsewhere is: tokens, nothing else."""
    sched = make_scheduler(num_blocks=32, block_size=4)
    spec = make_speculator(sched, k=3, proposer=ScriptedProposer())
    req = make_request(prompt=[1, 2, 3, 4, 5])
    req.token_ids += [10, 11]  # output produced on another replica
    sched.add(req)
    run_step(sched, token=12)  # recompute prompt + output, then the next token
    plan = spec.draft(sched.schedule())
    assert plan.chunks[0].draft_token_ids == (13, 14, 15)


def test_speculative_config_takes_vllm_s_keys_and_refuses_others_by_name():
    import pytest

    from cluster.app_config import AppConfig
    from cluster.config import EngineConfig, SpeculativeConfig

    cfg = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                       "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    assert cfg.speculative == SpeculativeConfig("ngram", 3, 2, 4)
    assert SpeculativeConfig.from_dict({"model": "/models/draft"}).method == "draft_model"
    with pytest.raises(ValueError, match="num_speculative_token"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_token": 3})
    with pytest.raises(ValueError, match="'eagle'"):
        SpeculativeConfig.from_dict({"method": "eagle"})
    with pytest.raises(ValueError, match="needs `model`"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_min=4, prompt_lookup_max=2)
    app = AppConfig.from_args({"speculative_config": {"method": "suffix"}})
    assert app.engine.speculative.method == "suffix"
    assert app.prefill_engine.speculative is None  # pattern methods run on the decode pool alone
    draft = AppConfig.from_args({"speculative_config": {"model": "/models/draft"}})
    assert draft.prefill_engine.speculative == draft.engine.speculative  # its prompt KV is made there
    with pytest.raises(ValueError, match="app arg"):
        AppConfig.from_args({"engine": {"speculative_config": {"method": "ngram"}}})
