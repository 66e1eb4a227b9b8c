"""The Serve app's frozen configuration, from its YAML `args`: the KV hand-off between the pools
(`KVTransferConfig`) and the app as a whole (`AppConfig`: mode, pools, SLOs, placement), composed
over the engine's configs (cluster/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from cluster.config import EngineConfig


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
