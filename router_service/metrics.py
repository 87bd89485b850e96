"""Prometheus text metrics of the router on a small HTTP endpoint (`/metrics`), for Grafana and the chart's
ServiceMonitor. Counters are plain Python; the engine updates them between steps."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Metrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.rejected = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.preemptions = 0
        self.micro_batch_overlaps = 0          # waits on one micro-batch's experts while another's were in flight
        self.gauges: dict[str, float] = {}
        self.phases: dict[str, float] = {}     # seconds spent per engine phase (schedule, forward, wait, ...)

    def render(self) -> str:
        with self.lock:
            lines = [
                "# HELP colibri_requests_total Finished requests by finish reason.",
                "# TYPE colibri_requests_total counter",
                *(f'colibri_requests_total{{finish_reason="{k}"}} {v}' for k, v in self.requests.items()),
                "# TYPE colibri_requests_rejected_total counter",
                f"colibri_requests_rejected_total {self.rejected}",
                "# TYPE colibri_prompt_tokens_total counter",
                f"colibri_prompt_tokens_total {self.prompt_tokens}",
                "# TYPE colibri_generation_tokens_total counter",
                f"colibri_generation_tokens_total {self.generation_tokens}",
                "# TYPE colibri_engine_steps_total counter",
                f"colibri_engine_steps_total {self.steps}",
                "# TYPE colibri_engine_step_seconds_total counter",
                f"colibri_engine_step_seconds_total {self.step_seconds:.6f}",
                "# HELP colibri_preemptions_total Running sequences preempted (KV cache full) and recomputed later.",
                "# TYPE colibri_preemptions_total counter",
                f"colibri_preemptions_total {self.preemptions}",
                "# HELP colibri_micro_batch_overlaps_total Waits on one micro-batch's experts while another "
                "micro-batch's experts were in flight too.",
                "# TYPE colibri_micro_batch_overlaps_total counter",
                f"colibri_micro_batch_overlaps_total {self.micro_batch_overlaps}",
            ]
            lines += ["# HELP colibri_engine_phase_seconds_total Engine time by phase; wait = blocked on workers, "
                      "expert_compute = the workers' own compute time (summed over workers).",
                      "# TYPE colibri_engine_phase_seconds_total counter",
                      *(f'colibri_engine_phase_seconds_total{{phase="{k}"}} {v:.6f}'
                        for k, v in sorted(self.phases.items()))]
            for name, value in sorted(self.gauges.items()):
                lines += [f"# TYPE colibri_{name} gauge", f"colibri_{name} {value:g}"]
        return "\n".join(lines) + "\n"

    def serve(self, host: str, port: int) -> int:
        metrics = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                body = metrics.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        server = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
        return server.server_address[1]


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (tests and the load generator read it)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out
