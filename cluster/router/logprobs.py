"""Logprobs in the shapes clients read them: OpenAI's chat and legacy completions objects, an
echoed prompt's entries, and vLLM's `prompt_logprobs` (the extra that scores a prompt)."""

from __future__ import annotations

import itertools
from typing import Any, Callable

from cluster.engine.outputs import Logprob, TokenLogprobs

Piece = Callable[[int], str]  # a token id's text


def openai_logprobs(kind: str, entries: list[TokenLogprobs], piece: Piece, offset: int = 0) -> dict[str, Any]:
    """OpenAI's logprobs object: chat's `content` list, or completions' parallel lists with
    `text_offset` counted from `offset` in the choice's text."""
    if kind == "chat":
        return {"content": [{"token": piece(e.sampled.token_id), "logprob": e.sampled.logprob,
                             "bytes": list(piece(e.sampled.token_id).encode()),
                             "top_logprobs": [{"token": piece(t.token_id), "logprob": t.logprob,
                                               "bytes": list(piece(t.token_id).encode())} for t in e.top]}
                            for e in entries]}
    tokens = [piece(e.sampled.token_id) for e in entries]
    starts = list(itertools.accumulate([offset] + [len(t) for t in tokens[:-1]]))[: len(tokens)]
    return {"tokens": tokens, "token_logprobs": [e.sampled.logprob for e in entries],
            "top_logprobs": [None if e.top is None else {piece(t.token_id): t.logprob for t in e.top}
                             for e in entries],
            "text_offset": starts}


def echo_entries(prompt_ids: list[int], scored: list[TokenLogprobs | None] | None,
                 k: int | None) -> list[TokenLogprobs]:
    """An echoed prompt's logprob entries: the first token's logprob and alternatives null
    (nothing precedes it), then the engine's scores with their top `k` alternatives; none
    when logprobs were not asked for."""
    if scored is None or k is None:
        return []
    first = TokenLogprobs(Logprob(prompt_ids[0], None), None)  # type: ignore[arg-type]
    return [first, *(TokenLogprobs(e.sampled, e.top[:k], e.rank) for e in scored[1:])]  # type: ignore[union-attr]


def vllm_prompt_logprobs(scored: list[TokenLogprobs | None], piece: Piece, k: int) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id (a
    string): {logprob, rank, decoded_token}} for the prompt's token and its top `k` alternatives."""
    out: list[dict[str, Any] | None] = []
    for e in scored:
        if e is None:
            out.append(None)
            continue
        entry = {str(e.sampled.token_id): {"logprob": e.sampled.logprob, "rank": e.rank,
                                           "decoded_token": piece(e.sampled.token_id)}}
        for rank, t in enumerate(e.top[:k], 1):
            entry.setdefault(str(t.token_id), {"logprob": t.logprob, "rank": rank, "decoded_token": piece(t.token_id)})
        out.append(entry)
    return out
