"""The front's own Prometheus metrics (`colibri_openai:` prefix): requests by endpoint and outcome, in flight,
latency to the last byte, tokens streamed. The router's metrics stay on the router."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from colibri.openai_api.responses import Reply
from colibri_common.metrics_http import LATENCY_BUCKETS, render, with_process


class FrontMetrics:
    def __init__(self) -> None:
        self.registry = with_process(CollectorRegistry(auto_describe=True))
        self.requests = Counter("colibri_openai:requests", "HTTP generation requests sent to the router, by "
                                "endpoint and outcome: ok; abort (the client left, before its first token or "
                                "after); or the HTTP status of an error, the router's refusals included. "
                                "colibri_openai:refused counts every error answer, those refused before the "
                                "router (bad input, a wrong key) included.",
                                ["endpoint", "outcome"], registry=self.registry)
        self.in_flight = Gauge("colibri_openai:requests_in_flight", "Generation requests open now (queued on the "
                               "router included).", registry=self.registry)
        self.latency = Histogram("colibri_openai:request_seconds", "From the request's send to the router to its "
                                 "last byte (or its end), by endpoint.", ["endpoint"], buckets=LATENCY_BUCKETS,
                                 registry=self.registry)
        self.generated = Counter("colibri_openai:generation_tokens", "Tokens passed on to clients.",
                                 registry=self.registry)
        self.errors = Counter("colibri_openai:refused", "Requests answered with an error status.", ["status"],
                              registry=self.registry)
    def started(self, reply: Reply) -> None:
        self.in_flight.inc()
        reply.counted = False

    def finished(self, reply: Reply, outcome: str) -> bool:
        """Once per request: the first outcome told is the one counted (True for that one)."""
        if reply.counted:
            return False
        reply.counted = True
        endpoint = "chat" if reply.chat else "completions"
        self.in_flight.dec()
        self.requests.labels(endpoint, outcome).inc()
        self.latency.labels(endpoint).observe(time.monotonic() - reply.t0)
        return True

    def tokens(self, n: int) -> None:
        self.generated.inc(n)

    def refused(self, status: int) -> None:
        self.errors.labels(str(status)).inc()

    def render(self) -> str:
        return render(self.registry)
