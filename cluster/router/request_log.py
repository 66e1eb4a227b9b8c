"""What the router records per request: latency histograms (TTFT and end-to-end, as the client
sees them), counters, and one trace per request joining what every part of the cluster did.

    track(request_id, child_id, deltas)   wraps a child's stream of token deltas:
        first delta          → vllm:time_to_first_token_seconds
        last delta           → vllm:e2e_request_latency_seconds; its `trace` (filled by the decode
                               replica: prefill replica and time, KV bytes and send/receive time,
                               decode queue wait, decode replica) + the router's own figures
                             → one JSON line on the `tandem.trace` logger, and kept in a bounded
                               ring for GET /debug/requests/{request_id}, and handed to the stats
                               board (`drain`) so every router replica can answer for it

A request whose stream ends without a finish (client gone, deadline, error) is traced too, with
`finish_reason` null and the error's type.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import sys
import time
from collections import Counter, OrderedDict, deque
from typing import Any, AsyncIterator

from cluster.metrics import E2E_BUCKETS, TTFT_BUCKETS, Histogram
from cluster.engine.outputs import TokenDelta

logger = logging.getLogger("tandem.trace")
KEEP_TRACES = 2048
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")  # what a client may send as X-Request-Id
# the HTTP request's id, for the traces of its children (set by the router per request)
current_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_request_id", default="")


class RequestLog:
    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.counters: Counter[str] = Counter()
        self.traces: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()  # request id → its children's
        self.unposted: deque[dict[str, Any]] = deque(maxlen=KEEP_TRACES)  # since the last `drain`

    async def track(self, request_id: str, child_id: str, deltas: AsyncIterator[list[TokenDelta]],
                    extra: dict[str, Any] | None = None) -> AsyncIterator[list[TokenDelta]]:
        """Forward `deltas`, observing them; `extra` (filled while they flow) joins the trace."""
        start = time.monotonic()
        first_at: float | None = None
        tokens, finish, trace, error = 0, None, None, None
        try:
            async for batch in deltas:
                if first_at is None:
                    first_at = time.monotonic()
                    self.ttft.observe(first_at - start)
                for d in batch:
                    tokens += len(d.token_ids)
                    finish = d.finish_reason or finish
                    trace = d.trace or trace
                yield batch
        except BaseException as exc:
            error = type(exc).__name__
            raise
        finally:
            end = time.monotonic()
            if finish is not None:
                self.e2e.observe(end - start)
            self.record({"request_id": request_id, "id": child_id, "router_replica": self.replica,
                         "finish_reason": finish, "error": error, "completion_tokens": tokens,
                         "ttft_s": None if first_at is None else round(first_at - start, 6),
                         "e2e_s": round(end - start, 6), **_rounded(trace or {}), **(extra or {})})

    def record(self, entry: dict[str, Any]) -> None:
        self.traces.setdefault(entry["request_id"], []).append(entry)
        self.traces.move_to_end(entry["request_id"])
        while len(self.traces) > KEEP_TRACES:
            self.traces.popitem(last=False)
        self.unposted.append(entry)
        logger.info(json.dumps(entry, sort_keys=True))

    def drain(self) -> list[dict[str, Any]]:
        """The traces recorded since the last call (for the stats board)."""
        out = list(self.unposted)
        self.unposted.clear()
        return out

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "histograms": {"vllm:time_to_first_token_seconds": self.ttft.to_dict(),
                                                "vllm:e2e_request_latency_seconds": self.e2e.to_dict()}}


def configure_trace_logging() -> None:
    """Trace lines go to the process's stderr (the replica's worker-*.err under Ray's logs dir),
    message only, as each request ends. The process's own stderr: under Ray's throughput mode
    (RAY_SERVE_THROUGHPUT_OPTIMIZED=1, which sets RAY_SERVE_LOG_TO_STDERR=0) Serve swaps a
    replica's `sys.stderr` for a writer into its own logger, which holds records in a buffer of
    RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE (1,000 there) before they reach its log file."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.__stderr__ or sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _rounded(trace: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 6) if isinstance(v, float) else v for k, v in trace.items()}
