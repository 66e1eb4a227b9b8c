"""What the in-process OpenAI tests share: the `stack` fixture's model name, a chat body, and
an SSE stream read into its JSON chunks."""

from __future__ import annotations

import asyncio
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
