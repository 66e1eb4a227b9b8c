"""The prefill pool batches prompts: several prefill-only requests computed in one engine step
give the same first tokens and the same prompt KV as each computed alone (so does a short
prompt that passes a long one between its chunks), and a prefill
replica that several prompts reach at once computes them in one step, with the replies a
colocated server gives."""

from __future__ import annotations

import asyncio
import threading

import torch

from cluster import LLM, SamplingParams
from openai_helpers import MODEL, run

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(100, 40000, (k,), generator=gen).tolist() for k in (5, 37, 20)]


def prefilled(engine, rids: list[str]) -> dict[str, tuple[int, torch.Tensor]]:
    """Step until each of `rids` is prefilled: rid → (first token, its packed prompt KV)."""
    got = {}
    while len(got) < len(rids):
        for out in engine.step():
            result = engine.take_prefilled(out.request_id)
            got[out.request_id] = (result.first_token, engine.export_kv(out.request_id))
            engine.release(out.request_id)
    return got


def test_prompts_prefilled_in_one_step_match_each_prefilled_alone(tiny_model_paths):
    folder = str(tiny_model_paths["llama"])
    batched, alone = LLM(folder).engine, LLM(folder).engine
    for i, prompt in enumerate(prompts()):
        batched.add_request(f"p{i}", prompt, GREEDY, prefill_only=True)
    steps = batched.step_cost.steps
    together = prefilled(batched, [f"p{i}" for i in range(3)])
    assert batched.step_cost.steps - steps == 1  # all three prompts in one forward pass

    for i, prompt in enumerate(prompts()):
        alone.add_request(f"p{i}", prompt, GREEDY, prefill_only=True)
        (first, kv), = prefilled(alone, [f"p{i}"]).values()
        assert together[f"p{i}"][0] == first  # greedy: the same first token
        assert together[f"p{i}"][1].shape == kv.shape
        torch.testing.assert_close(together[f"p{i}"][1], kv, rtol=1e-5, atol=1e-5)  # bit-exact here; a row count may change a kernel's rounding
    assert batched.stats()["blocks_in_use"] == 0 and alone.stats()["blocks_in_use"] == 0


def test_a_short_prompt_that_passes_a_long_one_between_its_chunks_changes_neither(tiny_model_paths):
    """prefill_schedule ttft with chunks of 64: a short prompt that arrives after a long one's
    first chunk is computed in the next step, and both give the first token and the prompt KV
    each gives alone."""
    from cluster.engine.step_cost import StepCost

    folder = str(tiny_model_paths["llama"])
    gen = torch.Generator().manual_seed(5)
    long, short = (torch.randint(100, 40000, (k,), generator=gen).tolist() for k in (300, 12))
    engine = LLM(folder, long_prefill_token_threshold=64).engine
    cost = StepCost()  # pinned, as a CPU measures it: a token costs much against a step's fixed part
    cost.fixed_s, cost.per_token_s, cost.resolved = 0.036, 0.005, True
    engine.scheduler.step_cost = cost
    engine.add_request("long", long, GREEDY, prefill_only=True)
    assert engine.step() == [] and engine.scheduler.requests["long"].num_computed_tokens == 64
    engine.add_request("short", short, GREEDY, prefill_only=True)
    order = []
    got = {}
    while len(got) < 2:
        outs = engine.step()
        order += [o.request_id for o in outs]
        for out in outs:
            result = engine.take_prefilled(out.request_id)
            got[out.request_id] = (result.first_token, engine.export_kv(out.request_id))
            engine.release(out.request_id)
    assert order == ["short", "long"]

    alone = LLM(folder).engine
    for rid, prompt in (("long", long), ("short", short)):
        alone.add_request(rid, prompt, GREEDY, prefill_only=True)
        (first, kv), = prefilled(alone, [rid]).values()
        assert got[rid][0] == first
        torch.testing.assert_close(got[rid][1], kv, rtol=1e-5, atol=1e-5)
    assert engine.stats()["blocks_in_use"] == 0


def test_a_prefill_replica_computes_prompts_that_arrive_together_in_one_step(stack):
    prefill = stack["prefill"]
    # plain prompts that share no block (a chat template's shared prefix would be computed once,
    # the prompts behind it waiting a step to take it from the cache)
    bodies = [{"model": MODEL, "prompt": text, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
              for text in ("Say something.", "Name three colours of the sea at dawn.", "Count to five.")]
    expected = [run(stack["colocated"].completions(b))["choices"][0]["text"] for b in bodies]

    async def go():
        gate = threading.Event()
        busy = asyncio.ensure_future(prefill.engine.call(gate.wait))  # the three queue up meanwhile
        tasks = [asyncio.create_task(stack["disagg"].completions(b)) for b in bodies]
        while len(prefill.queued) < len(bodies):
            await asyncio.sleep(0.005)
        steps = prefill.engine.steps
        gate.set()
        await busy
        replies = await asyncio.gather(*tasks)
        return [r["choices"][0]["text"] for r in replies], prefill.engine.steps - steps

    texts, steps = run(go())
    assert steps == 1 and texts == expected
    stats = run(prefill.stats())
    assert stats["blocks_in_use"] == 0 and stats["leases"] == 0


def test_a_prefill_replica_reports_what_is_left_of_each_prompt(stack):
    """What a decode replica's placement reads of the pool's queue (`queued_work`, `running_work`)
    and the prefill pool's router ranks by: each prompt's tokens still to compute, which shrink
    as its chunks run."""
    from cluster.prefill.server import LocalPrefillClient

    prefill, llm = stack["prefill"], stack["prefill"].engine.engine
    prompt = [(7 * i) % 30000 + 100 for i in range(600)]  # steps of 512 + 88
    chunked, resume = threading.Event(), threading.Event()
    real_step = llm.step

    def step():  # the engine thread holds after the prompt's first chunk until the test has looked
        outs = real_step()
        if prefill.queued and not chunked.is_set():
            chunked.set()
            resume.wait(30)
        return outs

    async def go():
        async def generate():
            async for _ in stack["decode"].generate("long", prompt, GREEDY, LocalPrefillClient(prefill)):
                pass

        task = asyncio.ensure_future(generate())
        assert await asyncio.to_thread(chunked.wait, 30)
        left = prefill.work_left()
        resume.set()
        await task
        return left

    llm.step = step
    try:
        assert run(go()) == ({}, {"long": 600 - 512})  # part way through its chunks
    finally:
        llm.step = real_step
        resume.set()
    stats = run(prefill.stats())
    assert prefill.work_left() == ({}, {}) and stats["queued_work"] == stats["running_work"] == []
