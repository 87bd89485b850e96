"""The router's metrics, named after vLLM's under a `colibri:` prefix, exposed with `prometheus_client`.

Counters and gauges are plain Python values the engine updates between steps (under `lock`); a collector
turns them into metric families at scrape time. Latencies are `prometheus_client` histograms, observed as
tokens leave: time to first token, inter-token latency, end-to-end request latency, and a finished request's
queue, prefill and decode times and sizes, as vLLM's. Other parts add
families through `sources` (the experts client: dispatch latency per worker, tokens per worker, expert
balance, and tokens routed per layer and expert when asked).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from colibri_common.metrics_http import LATENCY_BUCKETS, TOKEN_BUCKETS, render, serve_metrics, with_process
from colibri_common.metrics_http import parse as parse  # noqa: PLC0414 (re-exported for callers)

if TYPE_CHECKING:
    from router_service.engine.sequence import Sequence

# token counts per request or step: 1 to 32 Ki, doubling
SIZE_BUCKETS = tuple(float(2**i) for i in range(16))

GAUGE_HELP = {
    "num_requests_running": "Sequences in the running batch, taking steps (paused ones not counted).",
    "num_requests_paused": "Running sequences paused because their client reads too slowly (they hold their KV "
                           "blocks and take no steps until it catches up).",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Share of KV cache blocks in use (0-1).",
    "kv_cache_blocks_total": "KV cache blocks.",
    "kv_cache_blocks_free": "KV cache blocks free.",
    "batch_size": "Sequences in the last step (0 once the engine is idle).",
    "batch_size_max": "Most sequences in one step since start.",
    "batch_tokens": "Tokens (prefill + decode) in the last step (0 once the engine is idle).",
    "batch_tokens_max": "Most tokens in one step since start.",
}


class Metrics:
    def __init__(self, sources: Iterable[object] = ()) -> None:
        self.lock = threading.Lock()
        self.requests = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.rejected = 0
        self.refused = {"invalid": 0, "duplicate_id": 0, "draining": 0, "deadline": 0}   # at admission, by reason
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.preemptions = 0
        self.kv_blocks_shared = 0              # prompt blocks the n > 1 choices of a request took from the first
        self.micro_batch_overlaps = 0          # waits on one micro-batch's experts while another's were in flight
        self.prefetch_predicted = 0            # --expert-prefetch: experts predicted for the next MoE layer
        self.prefetch_right = 0                # ... that the layer then routed to
        self.graph_replays = 0                 # decode steps replayed from a CUDA graph
        self.gauges: dict[str, float] = {}
        self.phases: dict[str, float] = {}     # seconds spent per engine phase (schedule, forward, wait, ...)
        self.sources = list(sources)
        self.registry = with_process(CollectorRegistry(auto_describe=False))
        self.ttft = Histogram("colibri:time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("colibri:inter_token_latency_seconds", "Time between two tokens of one request.",
                             buckets=TOKEN_BUCKETS, registry=self.registry)
        self.e2e = Histogram("colibri:e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        # a finished request's phases and sizes, as vLLM's of the same names (its dashboards' panels read them)
        self.queue_time = Histogram("colibri:request_queue_time_seconds", "A finished request's time waiting "
                                    "before its first step.", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prefill_time = Histogram("colibri:request_prefill_time_seconds", "A finished request's time from its "
                                      "first step to its first token.", buckets=LATENCY_BUCKETS,
                                      registry=self.registry)
        self.decode_time = Histogram("colibri:request_decode_time_seconds", "A finished request's time from its "
                                     "first token to its last.", buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prompt_sizes = Histogram("colibri:request_prompt_tokens", "A finished request's prompt tokens.",
                                      buckets=SIZE_BUCKETS, registry=self.registry)
        self.output_sizes = Histogram("colibri:request_generation_tokens", "A finished request's generated "
                                      "tokens.", buckets=SIZE_BUCKETS, registry=self.registry)
        self.iteration_tokens = Histogram("colibri:iteration_tokens_total", "Tokens (prefill + decode) per engine "
                                          "step.", buckets=SIZE_BUCKETS, registry=self.registry)
        self.registry.register(self)

    def finished(self, seq: Sequence, now: float) -> None:
        """A request that ended with its tokens (stop or length): its latency, phases and sizes."""
        self.e2e.observe(now - seq.arrival)
        start = seq.scheduled_at if seq.scheduled_at is not None else now
        first = seq.first_token_at if seq.first_token_at is not None else now
        self.queue_time.observe(start - seq.arrival)
        self.prefill_time.observe(max(0.0, first - start))
        self.decode_time.observe(max(0.0, now - first))
        self.prompt_sizes.observe(len(seq.prompt_ids))
        self.output_sizes.observe(len(seq.output_ids))

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            done = CounterMetricFamily("colibri:request_success", "Finished requests by finish reason.",
                                       labels=["finished_reason"])
            for reason, n in self.requests.items():
                done.add_metric([reason], n)
            yield done
            refused = CounterMetricFamily("colibri:request_refused", "Requests refused at admission, by reason: "
                                          "invalid (a value that says what to fix), duplicate_id, draining, deadline "
                                          "(a full waiting queue is request_rejected).", labels=["reason"])
            for reason, n in self.refused.items():
                refused.add_metric([reason], n)
            yield refused
            for name, value, help_text in [
                ("request_rejected", self.rejected, "Requests refused because the waiting queue was full."),
                ("prompt_tokens", self.prompt_tokens, "Prompt tokens admitted."),
                ("generation_tokens", self.generation_tokens, "Tokens generated."),
                ("engine_steps", self.steps, "Engine steps run."),
                ("engine_step_seconds", self.step_seconds, "Seconds spent in engine steps."),
                ("kv_cache_blocks_shared", self.kv_blocks_shared,
                 "Prompt KV blocks shared by the choices of n > 1 requests instead of recomputed."),
                ("num_preemptions", self.preemptions, "Running sequences preempted (KV cache full), recomputed."),
                ("micro_batch_overlaps", self.micro_batch_overlaps,
                 "Waits on one micro-batch's experts while another micro-batch's were in flight too."),
                ("expert_prefetch_predicted", self.prefetch_predicted,
                 "Experts predicted for the next MoE layer (--expert-prefetch)."),
                ("expert_prefetch_right", self.prefetch_right, "Predicted experts the next MoE layer routed to."),
                ("cuda_graph_replays", self.graph_replays,
                 "Decode steps replayed from a CUDA graph (the in-process engine on a GPU; see the start-up log)."),
            ]:
                yield CounterMetricFamily(f"colibri:{name}", help_text, value=value)
            phases = CounterMetricFamily("colibri:engine_phase_seconds", "Engine time by phase; wait = blocked on "
                                         "workers, expert_compute = the workers' own compute (summed).",
                                         labels=["phase"])
            for phase, s in sorted(self.phases.items()):
                phases.add_metric([phase], s)
            yield phases
            for name, value in sorted(self.gauges.items()):
                yield GaugeMetricFamily(f"colibri:{name}", GAUGE_HELP.get(name, name.replace("_", " ")), value=value)
        for source in self.sources:
            yield from source.metric_families()

    def render(self) -> str:
        return render(self.registry)

    def serve(self, host: str, port: int) -> int:
        return serve_metrics(host, port, self.render)
