"""vLLM's request fields beyond OpenAI's that change what comes back, for clients written
against vLLM's server: checked here and turned into what the engine takes, or refused with a
400 where Tandem has no such thing. A vLLM field that is neither (a backend knob such as
`spaces_between_special_tokens`) is ignored like any unknown field.

    include_stop_str_in_output   the stop string that matched ends the text instead of being cut
    allowed_token_ids            only these tokens may be sampled
    bad_words                    never generated: each word, bare and after a space, as vLLM tokenizes
                                 them (its last token is banned where the output ends with the rest)
    truncate_prompt_tokens       keep the prompt's last k tokens (-1: the model's context length)
    use_beam_search              refused: no beam search here (sample n choices instead)
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from cluster.router.errors import APIError
from cluster.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS

MAX_BAD_WORD_CHARS = 256


class VllmExtras(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_stop_str_in_output: StrictBool = False
    allowed_token_ids: list[Annotated[int, Field(strict=True, ge=0)]] | None = Field(
        None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]] | None = Field(
        None, max_length=MAX_BAD_WORDS // 2)
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1)
    use_beam_search: StrictBool = False

    def check_extras(self) -> None:
        if self.use_beam_search:
            raise APIError(400, "use_beam_search is not supported: sample n choices instead", param="use_beam_search")
        if self.truncate_prompt_tokens == 0:
            raise APIError(400, "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (all of them when unset)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_ids
        return prompt_ids[-(max_model_len if k == -1 else k):]

    def token_fields(self, tokenizer: Any, vocab_size: int) -> dict[str, Any]:
        """These fields as SamplingParams takes them; `tokenizer` (HF) turns bad words into ids."""
        if self.allowed_token_ids is not None and max(self.allowed_token_ids) >= vocab_size:
            raise APIError(400, f"allowed_token_ids must be in [0, {vocab_size})", param="allowed_token_ids")
        words: list[tuple[int, ...]] = []
        for word in self.bad_words or ():
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise APIError(400, f"a bad word is longer than {MAX_BAD_WORD_TOKENS} tokens", param="bad_words")
                if ids and ids not in words:
                    words.append(ids)
        return {"include_stop_str_in_output": self.include_stop_str_in_output,
                "allowed_token_ids": None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
                "bad_words_token_ids": tuple(words)}
