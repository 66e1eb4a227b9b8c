"""In one process (no Ray): samples of one prompt (n > 1, or a burst of the same prompt) on one
decode replica take its KV across once and hold its full blocks once; colocated, they compute
them once."""

from __future__ import annotations

from openai_helpers import chat, run, settled


def test_n_samples_of_one_prompt_send_its_kv_once_and_hold_it_once(stack):
    """vLLM's RFC 39647 (n > 1 sends the same KV n times): here sibling samples wait for the first
    one's KV to land, then share its full blocks; only each one's last block crosses."""
    decode, hf = stack["decode"], stack["disagg"].tokenizer.hf
    words = " ".join(f"item{i}" for i in range(60))
    body = chat(temperature=1.0, seed=4, n=4, max_tokens=8, ignore_eos=True,
                messages=[{"role": "user", "content": f"Repeat after me: {words}"}])
    prompt_len = len(stack["disagg"].prepare("chat", body).children[0].prompt_ids)
    bs = decode.engine.engine.blocks.block_size
    before = dict(decode.connector.stats()), decode.importer.counters["kv_reused_blocks"]
    colocated_blocks = stack["colocated_server"].engine.engine.blocks
    hits = colocated_blocks.prefix_hits

    async def go():
        return [await stack[name].chat(body) for name in ("disagg", "colocated")]

    disagg, colocated = run(go())
    assert [c["message"] for c in disagg["choices"]] == [c["message"] for c in colocated["choices"]]
    block_bytes = decode.engine.engine.kv_layout().block_bytes
    full = (prompt_len - 1) // bs  # the blocks a sibling shares (the last one is always sent)
    assert full >= 5
    assert decode.importer.counters["kv_reused_blocks"] - before[1] == 3 * full
    sent = decode.connector.stats()["received_bytes"] - before[0].get("received_bytes", 0)
    assert sent == (-(-prompt_len // bs) + 3 * (-(-prompt_len // bs) - full)) * block_bytes
    assert decode.engine.engine.blocks.num_used_blocks == 0
    # colocated, the engine does the same: the later samples wait for the first to compute the
    # prompt's full blocks, then take them from its prefix cache
    assert colocated_blocks.prefix_hits - hits == 3 * full * bs


def test_a_sample_cancelled_while_it_waits_for_its_sibling_leaves_nothing_behind(stack):
    import asyncio

    from cluster.prefill.server import LocalPrefillClient
    from cluster.sampling_params import SamplingParams

    decode, prefill = stack["decode"], stack["prefill"]
    gate = asyncio.Event()  # the first one's prefill waits here, so the second one waits on it

    class GatedPrefill(LocalPrefillClient):
        async def prefill(self, *args, **kwargs):
            await gate.wait()
            return await super().prefill(*args, **kwargs)

    client = GatedPrefill(prefill)
    prompt = list(range(200, 300))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    waits = decode.counters["same_prompt_waits"]

    async def drain(rid):
        return [d for deltas in [x async for x in decode.generate(rid, prompt, params, client)] for d in deltas]

    async def go():
        first = asyncio.ensure_future(drain("first"))
        second = asyncio.ensure_future(drain("second"))
        deadline = asyncio.get_running_loop().time() + 10
        while decode.counters["same_prompt_waits"] == waits:  # the second is waiting for the first's KV
            assert asyncio.get_running_loop().time() < deadline, "the second sample never waited"
            await asyncio.sleep(0.01)
        second.cancel()
        gate.set()
        done = await first
        third = await drain("third")  # after it: takes the first's blocks, sends only the last one
        return done, third, second.cancelled(), *await settled(stack)

    done, third, cancelled, dstats, pstats = run(go())
    assert cancelled and decode.counters["same_prompt_waits"] == waits + 1
    assert [t for d in done for t in d.token_ids] == [t for d in third for t in d.token_ids]
    bs = decode.engine.engine.blocks.block_size
    assert third[-1].trace["kv_reused_tokens"] == (len(prompt) - 1) // bs * bs
    assert dstats["blocks_in_use"] == 0 and dstats["num_running"] == 0 and dstats["num_waiting"] == 0
    assert pstats["blocks_in_use"] == 0 and pstats["leases"] == 0
