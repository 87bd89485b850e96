"""An expert worker's own metrics (`colibri expert --metrics-port P`): what it computes and what it holds.

- colibri:expert_compute_seconds (histogram): one Forward's fused-MoE compute.
- colibri:expert_tokens_total: token rows computed; colibri:expert_forward_total{code}: calls by outcome.
- colibri:expert_resident_bytes: bytes of packed expert weights held; colibri:expert_streams_open.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from colibri_common.metrics_http import TOKEN_BUCKETS, render, serve_metrics


class WorkerMetrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tokens = 0
        self.calls = {"ok": 0, "invalid_argument": 0, "internal": 0}
        self.resident_bytes = 0
        self.streams_open = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.compute = Histogram("colibri:expert_compute_seconds", "One Forward's fused-MoE compute.",
                                 buckets=TOKEN_BUCKETS, registry=self.registry)
        self.registry.register(self)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            yield CounterMetricFamily("colibri:expert_tokens", "Token rows computed.", value=self.tokens)
            calls = CounterMetricFamily("colibri:expert_forward", "Forward calls (unary or stream messages) by "
                                        "outcome.", labels=["code"])
            for code, n in self.calls.items():
                calls.add_metric([code], n)
            yield calls
            yield GaugeMetricFamily("colibri:expert_resident_bytes", "Bytes of packed expert weights held.",
                                    value=self.resident_bytes)
            yield GaugeMetricFamily("colibri:expert_streams_open", "ForwardStream calls open.",
                                    value=self.streams_open)

    def count(self, code: str, rows: int = 0, seconds: float | None = None) -> None:
        with self.lock:
            self.calls[code] += 1
            self.tokens += rows
        if seconds is not None:
            self.compute.observe(seconds)

    def serve(self, host: str, port: int) -> int:
        return serve_metrics(host, port, lambda: render(self.registry))
