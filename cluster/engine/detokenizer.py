"""Token ids → streamed text: whole characters only, stop strings matched across tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"  # what a partial UTF-8 sequence decodes to
_PROMPT_CONTEXT = 5  # prompt tokens decoded ahead of the output, for its first leading space


class IncrementalDetokenizer:
    """One request's output text, grown a few tokens at a time.

    Each new token decodes a window of ids against the window's already-emitted prefix
    (the prefix_offset/read_offset scheme of vLLM and TGI; the window starts at ids[prefix]):

        window:  prefix ........ read | newer tokens
                 '- emitted before -' '- their text minus the prefix text is new; once it
                                         no longer ends in U+FFFD (a partial UTF-8 char),
                                         read moves to the end and prefix to the old read

    While the window ends mid-character, the complete characters before it are emitted
    already (tracked in `_emitted`), so byte-level tokens that straddle characters don't
    stall the stream. `tokenizer.decode` on id windows keeps every tokenizer's rules
    (byte-level BPE, SentencePiece leading spaces and byte fallback, added and special
    tokens); the window starts with the last few prompt tokens, so the first output token
    gets the leading space it has in the full text. A character cut off at the very end
    (max_tokens mid-character) is never emitted.

    `output_text` is everything decoded so far, cut just before the first stop string to
    complete (matched across token boundaries), or just after it with `include_stop`. `take_delta` hands out the part not yet
    taken, holding back (longest stop string - 1) characters until finished, so no part of
    a stop string that later matches is ever streamed.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = (),
                 include_stop: bool = False) -> None:
        self.tokenizer = tokenizer
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.stop_reason: str | None = None
        self.output_text = ""
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._sent = 0
        self._ids = [int(t) for t in prompt_token_ids[-_PROMPT_CONTEXT:]]  # window: prefix → newest
        self._read = len(self._ids)
        self._emitted = 0  # characters past the read offset already emitted

    def add_tokens(self, token_ids: Sequence[int]) -> str | None:
        """Append generated tokens; return the stop string that matched (output_text is then
        cut there, and later calls do nothing), else None."""
        if self.stop_reason is not None:
            return None
        for token_id in token_ids:
            text = self._decode_next(int(token_id))
            if not text:
                continue
            start = len(self.output_text)
            self.output_text += text
            if self.stop and self._match_stop(start):
                return self.stop_reason
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out. Until finished (or stopped), the last (longest stop string - 1)
        characters stay back, so a stop string split across steps is never streamed. All deltas
        together equal `output_text`; none holds half a character."""
        end = len(self.output_text)
        if not finished and self.stop_reason is None:
            end = max(end - self._holdback, self._sent)
        delta = self.output_text[self._sent:end]
        self._sent = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _decode_next(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_len = len(self._decode(self._ids[:self._read]))
        text = self._decode(self._ids)
        complete = text.rstrip(_REPLACEMENT)
        done = prefix_len + self._emitted
        if len(complete) <= done:
            return ""
        if len(complete) < len(text):  # a partial character at the end: keep the window open
            self._emitted = len(complete) - prefix_len
            return complete[done:]
        del self._ids[:self._read]  # the next window starts at the old read offset
        self._read, self._emitted = len(self._ids), 0
        return text[done:]

    def _match_stop(self, start: int) -> bool:
        """Look for stop strings ending in output_text[start:]; cut the text before the first to complete."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            idx = self.output_text.find(s, max(start - len(s) + 1, 0))
            if idx != -1 and (best is None or (idx + len(s), idx) < best[:2]):
                best = (idx + len(s), idx, s)
        if best is None:
            return False
        self.output_text = self.output_text[:best[0] if self.include_stop else best[1]]
        self.stop_reason = best[2]
        return True
