"""GET /metrics: what every replica of the app last posted to the stats board (routers, prefill
and decode pools), rendered as Prometheus text. Every series carries `pool`, `replica` and
`model_name` labels; sum over `replica` (or `pool`) in PromQL for the app-wide figure.

vLLM's names where they mean the same thing (dashboards for vLLM work unchanged):
    router   vllm:time_to_first_token_seconds, vllm:e2e_request_latency_seconds (client's view)
    decode   vllm:inter_token_latency_seconds (engine clock), vllm:request_success_total{finished_reason},
             vllm:generation_tokens_total, vllm:spec_decode_num_drafts / _draft_tokens / _accepted_tokens
             / _accepted_tokens_per_pos{position} (speculative decoding)
    both     vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc, vllm:prompt_tokens_total
             (where prompts are computed), vllm:prefix_cache_queries_total / _hits_total
plus disaggregation's own (tandem:*): KV transfer seconds and bytes, failures by stage and kind,
expired leases, prefill queue tokens, prefill retries, recomputes, KV blocks not sent (decode held
them), prompts prefilled on decode, migrations, rejections.
A replica that stops posting (gone) drops out after the board's STALE_S.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

Stat = Callable[[dict[str, Any]], float | None]
LABELS = ("pool", "replica", "model_name")


def _key(name: str) -> Stat:
    return lambda s: s.get(name)


def _ratio(num: str, den: str) -> Stat:
    return lambda s: s[num] / s[den] if s.get(den) else None


GAUGES: dict[str, tuple[str, Stat]] = {
    "vllm:num_requests_running": ("Requests in the engine's running batch.", _key("num_running")),
    "vllm:num_requests_waiting": ("Requests waiting for a step (decode: or for their prompt's KV).",
                                  lambda s: s["num_waiting"] + s.get("num_remote", 0) if "num_waiting" in s else None),
    "vllm:kv_cache_usage_perc": ("KV-cache usage, 0 to 1 (blocks in use / blocks).", _ratio("blocks_in_use", "num_blocks")),
    "tandem:prefix_cache_hit_rate": ("Prompt tokens served from the prefix cache / looked up, since start.",
                                     _ratio("prefix_cache_hits", "prefix_cache_queries")),
    "tandem:prefill_queue_tokens": ("Prompt tokens queued or being prefilled on a prefill replica.",
                                    _key("queued_prompt_tokens")),
    "tandem:kv_leases_held": ("Prefilled requests whose blocks wait for decode's ack.", _key("leases")),
    "tandem:step_seconds_per_token": ("What one more token adds to an engine step, fitted over its recent steps "
                                      "(engine/step_cost.py).", _key("step_s_per_token")),
    "tandem:requests_in_flight": ("Requests a router replica is serving.", _key("active")),
}
COUNTERS: dict[str, tuple[str, Stat]] = {
    "vllm:prompt_tokens": ("Prompt tokens admitted to an engine that computes them.", _key("prompt_tokens")),
    "vllm:generation_tokens": ("Tokens generated and streamed to callers.", _key("generation_tokens")),
    "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", _key("prefix_cache_queries")),
    "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", _key("prefix_cache_hits")),
    "vllm:num_preemptions": ("Requests preempted (blocks ran out) and later recomputed.", _key("num_preemptions")),
    "tandem:kv_transfer_bytes": ("KV bytes sent (prefill) or received and verified (decode).",
                                 lambda s: (s.get("kv_sent_bytes", 0) + s.get("kv_received_bytes", 0))
                                 if s.get("pool") in ("prefill", "decode") else None),
    "tandem:kv_reused_blocks": ("Prompt KV blocks a decode replica's prefix cache held, so not sent to it.",
                                _key("kv_reused_blocks")),
    "tandem:same_prompt_waits": ("Requests that waited for the same prompt's KV to land on their decode replica "
                                 "first (n samples, a burst), to share its blocks.", _key("same_prompt_waits")),
    "tandem:kv_leases_expired": ("Prefill blocks freed because decode never acknowledged them.", _key("lease_expired")),
    "tandem:kv_late_acks": ("Acknowledgements that came after their lease expired (ignored).", _key("late_acks")),
    "tandem:kv_recomputed": ("Prompts recomputed on decode after a failed prefill or transfer.", _key("recomputed")),
    "tandem:prefill_retries": ("Prefill calls retried on another replica after one was lost.", _key("prefill_retried")),
    "vllm:spec_decode_num_drafts": ("Speculative steps: a request verified one or more draft tokens.",
                                    _key("spec_num_drafts")),
    "vllm:spec_decode_num_draft_tokens": ("Draft tokens verified.", _key("spec_num_draft_tokens")),
    "vllm:spec_decode_num_accepted_tokens": ("Draft tokens accepted.", _key("spec_num_accepted_tokens")),
    "tandem:migrations": ("Streams moved to another decode replica after theirs died.", _key("migrations")),
    "tandem:requests_aborted": ("Requests abandoned by their caller (hang-up, deadline).", _key("aborted")),
}
# counters with one more label, read off prefixed stats keys: name → (help, key pattern, label)
LABELED: dict[str, tuple[str, re.Pattern[str], tuple[str, ...]]] = {
    "vllm:request_success": ("Requests finished, by finish reason.", re.compile(r"^finished_(\w+)$"),
                             ("finished_reason",)),
    "tandem:kv_transfer_failures": ("KV transfers refused or failed, by stage and kind.",
                                    re.compile(r"^kv_(send|receive|refused)_(\w+)$"), ("stage", "kind")),
    "tandem:local_prefills": ("Disaggregated prompts a decode replica prefilled itself, by reason "
                              "(short: within max_local_prefill_tokens; budget: within local_prefill_budget_ms; "
                              "slo: placement by ttft_slo_ms/itl_slo_ms; no_room: no blocks to receive).",
                              re.compile(r"^prefilled_locally_(\w+)$"), ("reason",)),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("Draft tokens accepted, by position in the draft (0 first).",
                                                      re.compile(r"^spec_accepted_pos_(\d+)$"), ("position",)),
    "tandem:requests_rejected": ("Requests refused before admission, by code.", re.compile(r"^rejected_(\w+)$"),
                                 ("code",)),
    "tandem:token_streams": ("Streams a router took from the decode pool, by path (multiplexed: over its channel "
                             "to that replica; own: the request's own stream).",
                             re.compile(r"^streams_(multiplexed|own)$"), ("path",)),
}
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "Seconds from the router receiving a request to its first token.",
    "vllm:e2e_request_latency_seconds": "Seconds from the router receiving a request to its last token.",
    "vllm:inter_token_latency_seconds": "Seconds between a request's consecutive tokens (decode engine clock).",
    "tandem:kv_transfer_seconds": "Seconds per KV transfer: send (prefill) or wait + verify (decode).",
}


class _Snapshot:
    def __init__(self, entries: list[dict[str, Any]], model_name: str) -> None:
        self.entries = sorted(entries, key=lambda s: (s.get("pool", ""), s.get("replica", "")))
        self.model_name = model_name

    def labels(self, s: dict[str, Any]) -> list[str]:
        return [str(s.get("pool", "")), str(s.get("replica", "")), self.model_name]

    def collect(self) -> Iterator[Metric]:
        for name, (doc, stat) in GAUGES.items():
            yield self._simple(GaugeMetricFamily(name, doc, labels=LABELS), stat)
        for name, (doc, stat) in COUNTERS.items():
            yield self._simple(CounterMetricFamily(name, doc, labels=LABELS), stat)
        for name, (doc, pattern, extra) in LABELED.items():
            family = CounterMetricFamily(name, doc, labels=LABELS + extra)
            for s in self.entries:
                for key, value in s.items():
                    m = pattern.match(key)
                    if m is not None and isinstance(value, (int, float)):
                        family.add_metric(self.labels(s) + list(m.groups()), value)
            yield family
        for name, doc in HISTOGRAMS.items():
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            for s in self.entries:
                h = (s.get("histograms") or {}).get(name)
                if h is not None:
                    buckets = [(repr(float(le)), c) for le, c in zip(h["le"], h["cumulative"])]
                    family.add_metric(self.labels(s), buckets + [("+Inf", h["count"])], h["sum"])
            yield family

    def _simple(self, family: Metric, stat: Stat) -> Metric:
        for s in self.entries:
            value = stat(s)
            if value is not None:
                family.add_metric(self.labels(s), float(value))
        return family


def render(entries: list[dict[str, Any]], model_name: str) -> bytes:
    """Prometheus text exposition (format 0.0.4) of these replicas' stats."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(entries, model_name))
    return generate_latest(registry)
