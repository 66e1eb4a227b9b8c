"""vLLM's request `priority` under `scheduling_policy: priority`, over the in-process OpenAI
server on real engines: a request sent later with a lower priority value is served first,
colocated (the decode engine's queue) and disaggregated (the prefill replica's line), and a
request's priority under the default first-come policy is refused, not silently ignored."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from cluster.router.errors import APIError
from openai_helpers import chat, run, serving_stack

SHORT = {"temperature": 0, "max_tokens": 2, "ignore_eos": True}


@pytest.fixture(scope="module")
def pools(tiny_model_paths):
    from cluster.prefill.server import LocalPrefillClient

    prefilled: list[str] = []  # request ids, in the order the prefill replica finished them

    class Recording(LocalPrefillClient):
        async def prefill(self, request_id, *args):
            handoff = await super().prefill(request_id, *args)
            prefilled.append(request_id)
            return handoff

    engine = {"num_blocks": 64, "max_num_seqs": 1, "scheduling_policy": "priority"}
    with serving_stack(str(tiny_model_paths["llama"]), engine, Recording) as s:
        yield {**s, "prefilled": prefilled}


def _carries_text(line: str) -> bool:
    """An SSE line whose chunk has text (however compactly its JSON is written)."""
    if not line.startswith("data: ") or line.strip() == "data: [DONE]":
        return False
    chunk = json.loads(line[6:])
    return any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or [])


async def first_tokens(server, engine, bodies: list[dict]) -> list[int]:
    """Streams the bodies, each sent once the one before it is in `engine` (running, then
    waiting); returns their indices in the order their first token arrived."""
    order: list[int] = []

    async def one(i: int, body: dict) -> None:
        async for line in await server.chat({**body, "stream": True}):
            if i not in order and _carries_text(line):
                order.append(i)

    tasks = []
    for i, body in enumerate(bodies):
        tasks.append(asyncio.create_task(one(i, body)))
        while sum(engine.routing_stats()[k] for k in ("num_running", "num_waiting")) <= i:
            await asyncio.sleep(0.005)
    await asyncio.gather(*tasks)
    return order


def test_colocated_a_later_request_with_a_lower_value_goes_first(pools):
    blocker = chat(temperature=0, max_tokens=200, ignore_eos=True)  # holds the one running slot
    bodies = [blocker, chat(priority=10, **SHORT), chat(priority=0, **SHORT), chat(priority=-10, **SHORT)]
    assert run(first_tokens(pools["colocated"], pools["colocated_server"], bodies)) == [0, 3, 2, 1]
    assert run(pools["colocated_server"].stats())["blocks_in_use"] == 0


def test_disaggregated_the_prefill_replica_takes_the_lowest_value_next_and_a_cancelled_one_leaves(pools):
    """The prefill engine is held busy while four prompts queue there (5, 5, -3, then 0, whose
    caller goes away while it waits): they run -3 first, then the two 5s as they came; the
    cancelled one never runs and holds nothing."""
    prefill, prefilled = pools["prefill"], pools["prefilled"]

    async def go():
        gate = threading.Event()
        busy = asyncio.ensure_future(prefill.engine.call(gate.wait))  # the engine thread is taken
        tasks = []
        for i, priority in enumerate((5, 5, -3, 0)):  # distinct prompts: the same one would wait for
            # the first's KV to land on the decode replica (same_prompt_waits), not queue at the prefill
            body = chat(priority=priority, **SHORT, messages=[{"role": "user", "content": f"Say something {i}."}])
            tasks.append(asyncio.create_task(pools["disagg"].chat(body)))
            while len(prefill.queued) < len(tasks):  # queued there in this order
                await asyncio.sleep(0.005)
        tasks[3].cancel()
        while len(prefill.queued) > 3:
            await asyncio.sleep(0.005)
        for _ in range(20):  # its abort reaches the engine's command queue (a few loop turns)
            await asyncio.sleep(0)
        prefilled.clear()
        gate.set()
        await busy
        replies = await asyncio.gather(*tasks[:3])
        await asyncio.gather(tasks[3], return_exceptions=True)
        return [r["id"] for r in replies], list(prefilled), await pools["decode"].stats(), await prefill.stats()

    before = run(prefill.stats())
    ids, order, dstats, pstats = run(go())
    assert order == [f"{ids[2]}-0", f"{ids[0]}-0", f"{ids[1]}-0"]  # -3 first, then the two 5s as they came
    assert pstats.get("cancelled", 0) - before.get("cancelled", 0) == 1
    assert pstats["steps"] - before["steps"] == 3  # one prompt a step (max_num_seqs 1): the cancelled one never ran
    assert dstats["blocks_in_use"] == 0 and pstats["blocks_in_use"] == 0 and pstats["leases"] == 0
    assert pstats["num_waiting"] == 0 and pstats["num_held"] == 0


def test_priority_needs_the_priority_policy(stack):
    with pytest.raises(APIError) as info:
        run(stack["colocated"].chat(chat(priority=1)))  # the stack's engines run first-come, first-served
    assert info.value.status == 400 and info.value.param == "priority" and "not enabled" in info.value.message
    assert run(stack["colocated"].chat(chat(priority=0, max_tokens=1)))["choices"]  # 0 is every request's
