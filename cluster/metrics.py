"""Latency histograms a replica keeps in plain Python (no torch, no prometheus_client): cheap to
observe on the engine's hot path, and posted as plain values to the app's stats board, where
the router renders every replica's into Prometheus text (cluster/router/metrics.py).

Bucket bounds follow vLLM's for the metrics that carry vLLM's names, so dashboards built for
vLLM read Tandem's series the same way.
"""

from __future__ import annotations

import bisect
from typing import Any, Sequence

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)
KV_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                       10.0, 30.0)


class Histogram:
    """Counts per bucket (upper bounds `buckets`, plus +Inf), sum and count. One writer."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def to_dict(self) -> dict[str, Any]:
        """Cumulative counts per upper bound, the way Prometheus exposes them."""
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return {"le": list(self.buckets), "cumulative": cumulative, "sum": self.sum, "count": self.count}
