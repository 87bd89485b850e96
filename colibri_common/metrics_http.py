"""Prometheus exposition (`prometheus_client`) on a small HTTP endpoint, `/metrics`, for any service.

Each service owns a private `CollectorRegistry` (several engines may live in one test process), and its
scrape-time values come from collectors that read the service's own counters. Torch-free.
"""

from __future__ import annotations

import collections
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from colibri_common.errors import ColibriError

# Request latencies from 1 ms to 10 min; inter-token latencies from 1 ms to 80 s (vLLM's ranges: a stall of a
# --worker-timeout or a preemption's recompute lands in a bucket, not +Inf).
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                 20.0, 40.0, 80.0)


class QueuedHistogram:
    """A prometheus `Histogram` (labelled or not, made with registry=None) whose observations a hot path queues, a
    deque's append and no lock. They are taken in by a thread of the process's own (`metrics-fold`, every
    FOLD_EVERY_S, CHUNK at a time with the GIL let go between chunks) and when the histogram is collected (register
    this, not the Histogram). For the calls of every MoE layer (a router's per-worker dispatch time, a worker's compute
    time): the Histogram's own observe takes a lock per bucket and one for the sum, on caches the layer's weights have
    just streamed through, where it cost 20-30 µs a call (docs/performance.md); taken in together, warm, they cost a
    few µs each, off the calls' path. The exposition is the Histogram's. Where the queue grows past CAP (no thread
    yet, in a forked child), the hot path takes in a chunk itself."""

    FOLD_EVERY_S = 1.0
    CHUNK = 256
    CAP = 1 << 16

    def __init__(self, histogram: Histogram) -> None:
        self.histogram = histogram
        self._queued: collections.deque[tuple[tuple[str, ...], float]] = collections.deque()
        _folder.add(self)

    def observe(self, value: float, *labels: str) -> None:
        self._queued.append((labels, value))
        if len(self._queued) > self.CAP:
            self.fold(self.CHUNK)

    def fold(self, limit: int | None = None) -> bool:
        """Take the queued observations (at most `limit`) into the Histogram; whether some are still queued.
        popleft is atomic: two folders take each observation once."""
        queued, h = self._queued, self.histogram
        n = 0
        while queued and (limit is None or n < limit):
            try:
                labels, value = queued.popleft()
            except IndexError:
                break
            (h.labels(*labels) if labels else h).observe(value)
            n += 1
        return bool(queued)

    def collect(self) -> Iterator[Metric]:
        self.fold()
        return iter(self.histogram.collect())


class _Folder:
    """The process's `metrics-fold` thread for its QueuedHistograms, started with the first one (again in a forked
    child, which inherits the list but not the thread)."""

    def __init__(self) -> None:
        self._all: weakref.WeakSet[QueuedHistogram] = weakref.WeakSet()
        self._pid = 0
        self._lock = threading.Lock()

    def add(self, h: QueuedHistogram) -> None:
        with self._lock:
            self._all.add(h)
            if self._pid != os.getpid():
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="metrics-fold", daemon=True).start()

    def _run(self) -> None:
        while True:
            time.sleep(QueuedHistogram.FOLD_EVERY_S)
            for h in list(self._all):
                while h.fold(QueuedHistogram.CHUNK):
                    time.sleep(0)                    # the GIL to whoever waits for it (a step) between chunks


_folder = _Folder()


def with_process(registry: CollectorRegistry) -> CollectorRegistry:
    """`registry` with the process's own families (process_resident_memory_bytes, process_cpu_seconds_total,
    process_open_fds, process_start_time_seconds: what a dashboard's restart and memory panels read)."""
    ProcessCollector(registry=registry)
    return registry


def render(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def serve_metrics(host: str, port: int, body: Callable[[], str]) -> int:
    """Serve `body()` at http://HOST:PORT/metrics on a daemon thread; returns the bound port."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server API)
            if self.path.split("?")[0] != "/metrics":
                self.send_error(404, "only /metrics is served here")
                return
            data = body().encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET     # :: and fd00::7 too

    try:
        server = Server((host.strip("[]"), port), Handler)
    except OSError as exc:                   # a busy port: one line at start, not a traceback
        raise ColibriError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} (--metrics-port)") from None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server.server_address[1]


def parse(text: str) -> dict[str, float]:
    """Exposition text -> {'name{label="v",...}': value} per sample (labels sorted), with
    `prometheus_client.parser`: what tests, the load generator and the benchmarks read."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out
