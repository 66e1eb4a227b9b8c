"""What the in-process OpenAI tests share: the servers behind the `stack` fixture
(`serving_stack`), its model name, a chat body, and an SSE stream read into its JSON chunks."""

from __future__ import annotations

import asyncio
import contextlib
import json

MODEL = "tiny"  # the served name of the `stack` fixture (tests/integration/conftest.py)


def run(coro):
    return asyncio.run(coro)


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], **kw}


async def drain(stream) -> list[dict]:
    out = []
    async for line in stream:
        assert line.startswith("data: ") and line.endswith("\n\n")
        payload = line[len("data: "):].strip()
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# Two greedy runs of one prompt agree token for token unless the top two choices are closer
# than float noise: a row's logprobs move by up to ~2.4e-6 (tiny model) / ~1.2e-5 (default
# model) with the batch it shares a step with (CPU fp32, measured 2026-11-26), while the
# closest top-2 gaps along the replies the tests compare are >= 0.04.
NEAR_TIE = 1e-4


def greedy_agreement(tokens: list[str], other: list[str], top_logprobs: list[dict[str, float]]) -> int:
    """Assert that `other`, a second greedy run, is `tokens` up to the first near-tie of the
    first run (top two logprobs within NEAR_TIE), where it may take either; return how many
    leading tokens had to agree."""
    gaps = [sorted(top.values(), reverse=True) for top in top_logprobs]
    tie = next((i for i, g in enumerate(gaps) if len(g) > 1 and g[0] - g[1] < NEAR_TIE), len(tokens))
    assert other[:tie] == tokens[:tie], (tokens, other)
    if tie < len(tokens):
        assert other[tie] in top_logprobs[tie], (tie, other[tie], top_logprobs[tie])
    return tie


def idle(decode: dict, prefill: dict) -> bool:
    return (decode["blocks_in_use"] == 0 and decode["num_running"] == 0 and decode["num_waiting"] == 0
            and prefill["blocks_in_use"] == 0 and prefill.get("leases", 0) == 0)


async def settled(stack, timeout_s: float = 10.0) -> tuple[dict, dict]:
    """The decode and prefill servers' stats once both hold nothing (or when `timeout_s` is up,
    for the caller's assertions to say what is left): an aborted request is freed on the
    engine's next step, not at once."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        stats = await stack["decode"].stats(), await stack["prefill"].stats()
        if idle(*stats) or loop.time() > deadline:
            return stats
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def serving_stack(model_path: str, engine: dict, client_for=None, app: dict | None = None):
    """A prefill and a decode server (disaggregated), a colocated decode server, and an OpenAI
    server over each pair; `client_for(prefill)`: the decode side's PrefillClient (default:
    LocalPrefillClient). Engine args apply to all three engines, `app`: more app args."""
    from cluster.app_config import AppConfig
    from cluster.decode.server import DecodeServer
    from cluster.engine.tokenizer import Tokenizer
    from cluster.prefill.server import LocalPrefillClient, PrefillServer
    from cluster.router.openai_server import OpenAIServer

    args = {"model": model_path, "engine": engine, "kv_transfer": {"connector": "tcp"}, **(app or {})}
    prefill = PrefillServer(AppConfig.from_args(args))
    decode = DecodeServer(AppConfig.from_args(args))
    colocated = DecodeServer(AppConfig.from_args({**args, "mode": "colocated"}))
    tok = Tokenizer(model_path)
    client = (client_for or LocalPrefillClient)(prefill)
    policy = engine.get("scheduling_policy", "fcfs")

    def server(dec, pre):
        return OpenAIServer(MODEL, tok, 1024, lambda rid, ids, p: dec.generate(rid, ids, p, pre),
                            scheduling_policy=policy)

    try:
        yield {"disagg": server(decode, client), "colocated": server(colocated, None),
               "decode": decode, "prefill": prefill, "colocated_server": colocated}
    finally:
        for s in (prefill, decode, colocated):
            s.close()
