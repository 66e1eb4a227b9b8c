"""A decode replica's multiplexed path on a real engine, in one process (no Ray): a request whose
router has a channel open gets the tokens it would get on its own stream, its outputs put into
the channel as the engine hands them over (decode/server.py diverts its stream: no task wakes
per token); the last delta carries the trace; a channel that closes mid-request aborts it and
gives its blocks back; in a burst after a pause, the requests behind the first compute while their
router subscribes and then stream over its channel (or, with no subscription, on their own)."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.engine.outputs import StreamStart, TokenDelta
from cluster.sampling_params import SamplingParams

PROMPT = [1, 415, 5834, 314, 4649, 28, 351, 260, 1159]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_model_paths):
    from cluster.app_config import AppConfig
    from cluster.decode.server import DecodeServer

    s = DecodeServer(AppConfig.from_args({"model": str(tiny_model_paths["llama"]), "mode": "colocated",
                                          "engine": {"num_blocks": 64, "max_num_seqs": 8}}))
    yield s
    s.close()


async def own_stream(server, rid: str, router: str = "router-1") -> list:
    return [item async for item in server.generate(rid, PROMPT, PARAMS, mux=router)]


async def settle(server) -> dict:
    for _ in range(200):
        stats = await server.stats()
        if stats["blocks_in_use"] == 0:
            return stats
        await asyncio.sleep(0.01)
    return stats


def test_on_a_channel_a_request_gets_its_own_streams_tokens_and_its_trace_last(server):
    async def go():
        alone = await own_stream(server, "alone")  # no channel open: everything on its own stream
        batches = server.channels.serve("router-1")
        first = asyncio.ensure_future(batches.__anext__())
        await asyncio.sleep(0)  # the channel is open once serve() runs
        itl_before = server.itl.count
        items = await own_stream(server, "muxed")
        got: list[TokenDelta] = []
        batch = await first
        while True:
            got += batch.get("muxed", [])
            if got and got[-1].finish_reason is not None:
                break
            batch = await batches.__anext__()
        await batches.aclose()
        return alone, items, got, server.itl.count - itl_before, await settle(server)

    alone, items, got, itl_observed, stats = asyncio.run(go())
    assert alone[0] == StreamStart(server.name, False) and items == [StreamStart(server.name, True)]
    own = TokenDelta.concat([d for item in alone[1:] for d in item])
    muxed = TokenDelta.concat(got)
    assert muxed.token_ids == own.token_ids and len(own.token_ids) == 12
    assert muxed.text == own.text and muxed.finish_reason == own.finish_reason == "length"
    assert muxed.trace["decode_replica"] == server.name and "decode_queue_s" in muxed.trace
    assert all(d.trace is None for d in got[:-1])
    assert itl_observed == 11  # one gap per token after the first, as on its own stream
    assert stats["blocks_in_use"] == 0


def test_a_channel_that_closes_mid_request_aborts_it_and_frees_its_blocks(server):
    async def go():
        batches = server.channels.serve("router-2")
        first = asyncio.ensure_future(batches.__anext__())
        await asyncio.sleep(0)
        aborted = server.counters["aborted"]
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

        async def call():
            return [item async for item in server.generate("cut", PROMPT, long, mux="router-2")]

        running = asyncio.ensure_future(call())
        batch = await first
        assert "cut" in batch and batch["cut"][-1].finish_reason is None
        await batches.aclose()  # the router gave its channel up
        with pytest.raises((asyncio.CancelledError, RuntimeError)):
            await running
        stats = await settle(server)
        return server.counters["aborted"] - aborted, stats

    aborted, stats = asyncio.run(go())
    assert aborted == 1
    assert stats["blocks_in_use"] == 0 and stats["num_running"] == 0


def test_a_burst_after_a_pause_computes_while_its_router_subscribes_then_goes_over_the_channel(server):
    async def go():
        teller = asyncio.ensure_future(own_stream(server, "teller", "router-3"))  # finds no channel
        await asyncio.sleep(0)
        behind = asyncio.ensure_future(own_stream(server, "behind", "router-3"))
        await teller
        await asyncio.sleep(0.3)  # the subscription comes late: "behind" has run to its end meanwhile
        done_before = behind.done()
        batches = server.channels.serve("router-3")
        got: list[TokenDelta] = []
        async for batch in batches:
            got += batch.get("behind", [])
            if got and got[-1].finish_reason is not None:
                break
        await batches.aclose()
        return await teller, await behind, done_before, got, await settle(server)

    told, items, done_before, got, stats = asyncio.run(go())
    assert told[0] == StreamStart(server.name, False) and not done_before
    assert items == [StreamStart(server.name, True)]
    own = TokenDelta.concat([d for item in told[1:] for d in item])
    muxed = TokenDelta.concat(got)
    assert muxed.token_ids == own.token_ids and muxed.text == own.text and len(own.token_ids) == 12
    assert len(got[0].token_ids) > 1  # computed while the subscription was on its way, sent at once
    assert muxed.finish_reason == "length" and muxed.trace["decode_replica"] == server.name
    assert stats["blocks_in_use"] == 0


def test_a_burst_whose_router_never_subscribes_streams_on_its_own_when_the_wait_ends(server):
    from cluster.decode.channels import SUBSCRIBE_WAIT_S

    async def go():
        teller = asyncio.ensure_future(own_stream(server, "teller-4", "router-4"))
        await asyncio.sleep(0)
        started = time.monotonic()
        items = await own_stream(server, "behind-4", "router-4")
        return await teller, items, time.monotonic() - started, await settle(server)

    told, items, waited, stats = asyncio.run(go())
    assert told[0] == items[0] == StreamStart(server.name, False)
    own, behind = (TokenDelta.concat([d for item in x[1:] for d in item]) for x in (told, items))
    assert behind.token_ids == own.token_ids and behind.finish_reason == "length"
    assert waited >= SUBSCRIBE_WAIT_S - 0.1  # its tokens waited for the subscription that never came
    assert stats["blocks_in_use"] == 0
