"""Per-request sampling parameters (plain values, no torch), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from cluster.structured_output import StructuredOutput

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit)
MAX_ABS_LOGIT_BIAS = 100.0
MAX_CACHE_SALT_CHARS = 256
MAX_ABS_PRIORITY = 2**31  # priorities are in [-2**31, 2**31)
MAX_ALLOWED_TOKEN_IDS = 1 << 17
MAX_BAD_WORDS = 128  # token sequences (each bad word gives one or two)
MAX_BAD_WORD_TOKENS = 64


@dataclass(frozen=True)
class SamplingParams:
    """What vLLM users expect, with the same names and defaults.

    temperature == 0 means greedy. `seed` makes a request's random sampling reproducible
    regardless of what else is in the batch. `logprobs=k` returns the sampled token's
    logprob plus the top-k alternatives (k may be 0); `prompt_logprobs=k` the same for each
    prompt token after the first, from the model's own logits at the position before it (the
    whole prompt is computed: no prefix-cache hits for such a request). Stop strings are matched across
    token boundaries and are not included in the output text (vLLM's `include_stop_str_in_output`
    keeps the one that matched). vLLM's `allowed_token_ids` keeps only those tokens samplable;
    `bad_words_token_ids` (vLLM's `bad_words`, tokenized by the router) bans each sequence's last
    token wherever the output ends with the ones before it. `logit_bias` adds a bias in
    [-100, 100] to the logits of the token ids it names before sampling (-100 bans a token in
    practice, 100 all but forces it), as OpenAI's `logit_bias`. `structured` holds the reply to
    a JSON object, a JSON schema, a regex, a choice, an EBNF grammar or a structural tag
    (cluster/structured_output.py says what each takes and what is refused; the engine enforces
    it through engine/structured/). `prior_output_tokens` says how many of the prompt's last
    tokens are the request's own earlier output (a migrated request), which a structured reply
    continues from. `cache_salt` (vLLM's) keeps the request's prefix-cache
    blocks apart from those of requests without the same salt: tenants that do not share a salt
    never hit each other's cache, so none can time another's prompts. `priority` (vLLM's request
    priority, carried here so it travels with the request through both pools): under the engine's
    `scheduling_policy: priority`, lower values are scheduled first; under "fcfs" it must be 0.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    structured: StructuredOutput | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    prior_output_tokens: int = 0
    cache_salt: str | None = None
    priority: int = 0
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias or ()
        object.__setattr__(self, "logit_bias", tuple((t, b) for t, b in bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(msg)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad(f"n must be an integer >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise bad(f"{name} must be a finite number, got {value!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise bad(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise bad(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise bad(f"stop strings must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        if any(t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative token ids")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad(f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise bad(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if (not isinstance(bias, (int, float)) or isinstance(bias, bool) or not math.isfinite(bias)
                    or abs(bias) > MAX_ABS_LOGIT_BIAS):
                raise bad(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
        if not isinstance(self.prior_output_tokens, int) or self.prior_output_tokens < 0:
            raise bad(f"prior_output_tokens must be an integer >= 0, got {self.prior_output_tokens!r}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str)
                                            or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS):
            raise bad(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
        if (not isinstance(self.priority, int) or isinstance(self.priority, bool)
                or not -MAX_ABS_PRIORITY <= self.priority < MAX_ABS_PRIORITY):
            raise bad(f"priority must be an integer in [-2**31, 2**31), got {self.priority!r}")
        self._validate_token_sets()
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            raise bad("logit_bias names a token id more than once")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise bad("structured must be a StructuredOutput")

    def _validate_token_sets(self) -> None:
        def ids(xs: tuple) -> bool:
            return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in xs)

        allowed = self.allowed_token_ids
        if allowed is not None and not (0 < len(allowed) <= MAX_ALLOWED_TOKEN_IDS and ids(allowed)):
            raise ValueError(f"allowed_token_ids must be 1 to {MAX_ALLOWED_TOKEN_IDS} token ids (integers >= 0)")
        words = self.bad_words_token_ids
        if len(words) > MAX_BAD_WORDS or not all(0 < len(w) <= MAX_BAD_WORD_TOKENS and ids(w) for w in words):
            raise ValueError(f"bad_words_token_ids must be at most {MAX_BAD_WORDS} sequences of 1 to "
                             f"{MAX_BAD_WORD_TOKENS} token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
