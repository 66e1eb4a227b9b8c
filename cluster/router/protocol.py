"""OpenAI request schemas (what clients may send) and their mapping to `SamplingParams`.

Unknown fields are ignored, as OpenAI and vLLM do; fields that only Tandem's internals
set (KV-transfer parameters and the like) are therefore never read from a client. Known
OpenAI features this server does not implement (tool_choice "auto", `functions`, `suffix`,
`best_of`) are refused with a 400 naming them, never silently dropped (tool calls:
router/tools.py). What a reply is held to (`response_format`, vLLM's `structured_outputs`) is
checked by router/structured.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from cluster.engine.tokenizer import RESERVED_TEMPLATE_VARIABLES
from cluster.router.errors import APIError
from cluster.router.structured import GUIDED, held_to
from cluster.router.vllm_extras import VllmExtras
from cluster.sampling_params import (MAX_ABS_PRIORITY, MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, MAX_LOGPROBS,
                                     SamplingParams)
from cluster.structured_output import MAX_PATTERN_CHARS, StructuredOutput

MAX_N = 16
MAX_CHOICES = 64  # prompts x n in one /v1/completions request
MAX_OPTIONS = 256  # structured_outputs.choice
MAX_OPTION_CHARS = 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)


def clean_text(v: Any) -> Any:
    """Text the tokenizer can take: valid Unicode (no lone surrogates, which JSON's \\ud800
    escapes can smuggle in) and no NUL characters."""
    if isinstance(v, str):
        if "\x00" in v:
            raise ValueError("must not contain NUL characters")
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("must be valid Unicode (it contains a lone surrogate)") from None
    return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str

    _clean = field_validator("text")(clean_text)


class ToolCallFunction(_Strict):
    name: str
    arguments: str

    _clean = field_validator("name", "arguments")(clean_text)


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    _clean = field_validator("content")(clean_text)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        for part in v if isinstance(v, list) else ():
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValueError("only parts of type 'text' are supported: this model reads text only")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def as_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it (developer is the system role)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatPrompt(_Strict):
    """What a chat's prompt is made of (chat completions, /tokenize): the messages, the tools
    (checked by router/tools.py), and vLLM's say on where the prompt ends: a new assistant turn
    (`add_generation_prompt`), or inside the last message (`continue_final_message`, with
    add_generation_prompt false), for the reply to go on with it. `chat_template_kwargs`: vLLM's
    extra template variables; those the template does not read are ignored, as in vLLM, and one
    the server sets itself (messages, tools, chat_template, special tokens...) is a 400."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        reserved = sorted(RESERVED_TEMPLATE_VARIABLES.intersection(v or {}))
        if reserved:
            raise ValueError(f"{reserved[0]!r} is the server's to set, not a template variable a request may pass")
        return v


def clean_texts(v: Any) -> Any:
    """`clean_text` of a text, or of each text of a list."""
    for x in v if isinstance(v, list) else [v]:
        clean_text(x)
    return v


Choices = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_OPTION_CHARS)]],
                    Field(min_length=1, max_length=MAX_OPTIONS)]
Pattern = Annotated[str, Field(min_length=1, max_length=MAX_PATTERN_CHARS)]


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` (router/structured.py says what each key holds a reply to)."""

    choice: Choices | None = None
    regex: Pattern | None = None
    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    json_object: StrictBool | None = None
    grammar: Any = None
    structural_tag: Any = None
    whitespace_pattern: Any = None

    _clean = field_validator("choice", "regex")(clean_texts)


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: with include_usage, usage in every chunk


class _Sampling(_Strict, VllmExtras):
    model: str
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: StrictInt | None = Field(None, ge=0, lt=2**63)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    max_tokens: StrictInt | None = Field(None, ge=1)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(0, ge=0)
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    user: str | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    guided_json: Union[dict[str, Any], str, None] = None  # vLLM's before 0.12: structured_outputs'
    guided_regex: Pattern | None = None
    guided_choice: Choices | None = None
    guided_grammar: str | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's extra (lax, as vLLM: true is 1)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)  # vLLM's: a tenant's own cache
    priority: StrictInt = Field(0, ge=-MAX_ABS_PRIORITY, lt=MAX_ABS_PRIORITY)  # vLLM's: lower runs first

    @field_validator("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and v != v:
            raise ValueError("must be a finite number")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise ValueError("keys must be token ids (non-negative integers, as strings)")
        if len(v or {}) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens")
        if len({int(k) for k in v or {}}) != len(v or {}):
            raise ValueError("a token id is named more than once")
        return v

    def held(self) -> StructuredOutput | None:
        """What the reply is held to (response_format, structured_outputs), checked: 400s name the field."""
        structured = self.structured_outputs
        guided = {k: getattr(self, k) for k in GUIDED if getattr(self, k) is not None}
        return held_to(self.response_format,
                       None if structured is None else structured.model_dump(by_alias=True, exclude_none=True),
                       guided)

    def logit_bias_ids(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """`logit_bias` as (token id, bias) pairs, every id inside the vocabulary."""
        pairs = tuple((int(k), b) for k, b in (self.logit_bias or {}).items())
        if any(t >= vocab_size for t, _ in pairs):
            raise APIError(400, f"logit_bias token ids must be in [0, {vocab_size})", param="logit_bias")
        return pairs

    _clean_salt = field_validator("cache_salt")(clean_text)
    _clean_texts = field_validator("stop", "guided_regex", "guided_choice", "guided_grammar", "bad_words")(clean_texts)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.stream and self.prompt_logprobs is not None:  # as in vLLM
            raise APIError(400, "prompt_logprobs is not available when stream is true", param="prompt_logprobs")

    def requested_prompt_logprobs(self) -> int | None:
        """How many alternatives each prompt token's score carries, or None: not scored."""
        return self.prompt_logprobs

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        logit_bias: tuple[tuple[int, float], ...] = (), **extras: Any) -> SamplingParams:
        held = self.held()
        try:
            return SamplingParams(
                n=1,
                temperature=1.0 if self.temperature is None else float(self.temperature),
                top_p=1.0 if self.top_p is None else float(self.top_p),
                top_k=0 if self.top_k is None else self.top_k,
                min_p=self.min_p or 0.0,
                seed=self.seed,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                stop=tuple([self.stop] if isinstance(self.stop, str) else (self.stop or [])),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=logit_bias,
                structured=held,
                cache_salt=self.cache_salt,
                priority=self.priority,
                **extras,
            )
        except ValueError as exc:
            raise APIError(400, str(exc)) from None


class ChatCompletionRequest(_Sampling, ChatPrompt):
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    functions: list[Any] | None = None

    def check_supported(self) -> None:
        self.held()
        if self.functions:
            raise APIError(400, "functions (the deprecated form of tools) is not supported: send tools",
                           param="functions")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False
    max_tokens: StrictInt | None = Field(None, ge=0)  # 0: with echo only (the prompt scored, nothing generated)
    suffix: str | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        """A string, a list of token ids, or a batch: a list of either (not mixed)."""
        def ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(type(t) is int for t in x)

        if isinstance(v, str) or ids(v):
            return clean_text(v)
        if isinstance(v, list) and v and (all(isinstance(x, str) for x in v) or all(ids(x) for x in v)):
            for x in v:
                clean_text(x)
            return v
        raise ValueError("must be a string, a non-empty list of token ids, or a batch: a non-empty "
                         "list of strings or of token id lists")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or each of a batch."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    def check_supported(self) -> None:
        self.held()
        if self.suffix:
            raise APIError(400, "suffix is not supported (no fill-in-the-middle)", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of is not supported: ask for n samples instead", param="best_of")
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise APIError(400, f"{len(self.prompts())} prompts x n={self.n} exceeds {MAX_CHOICES} choices "
                                "per request", param="prompt")
        if self.max_tokens == 0 and (not self.echo or self.min_tokens):
            raise APIError(400, "max_tokens 0 is for echo alone (the prompt scored, nothing generated; "
                                "no min_tokens)", param="max_tokens")

    @property
    def echo_only(self) -> bool:
        """`echo` with `max_tokens: 0`: the engine still samples one token, which is dropped."""
        return self.echo and self.max_tokens == 0

    def requested_max_tokens(self) -> int | None:
        if self.max_tokens == 0:
            return 1
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's completions default

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """`echo` with `logprobs` scores the prompt's tokens too (the first one has none), as
        `prompt_logprobs` does; with both, the larger number of alternatives is scored."""
        ks = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(ks, default=None)
