"""colibri_common.metrics_http.QueuedHistogram: observations queued on the hot path (a router's per-worker dispatch
time, a worker's compute time, once a MoE layer) and taken in when scraped give the exposition a plain prometheus
Histogram gives, none lost or counted twice, from any number of threads."""

from __future__ import annotations

import threading
import time

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from colibri_common.metrics_http import TOKEN_BUCKETS, QueuedHistogram

VALUES = [0.0, 0.0005, 0.001, 0.0011, 0.005, 0.3, 1.0, 79.0, 81.0, 1e9]


def _exposition(registry: CollectorRegistry) -> list[str]:
    return [line for line in generate_latest(registry).decode().splitlines()
            if not line.startswith("#") and "_created" not in line]


def _pair(labels: tuple[str, ...]) -> tuple[CollectorRegistry, Histogram, CollectorRegistry, QueuedHistogram]:
    plain_reg, queued_reg = CollectorRegistry(), CollectorRegistry()
    plain = Histogram("t_seconds", "t", list(labels), buckets=TOKEN_BUCKETS, registry=plain_reg)
    queued = QueuedHistogram(Histogram("t_seconds", "t", list(labels), buckets=TOKEN_BUCKETS, registry=None))
    queued_reg.register(queued)
    return plain_reg, plain, queued_reg, queued


def test_the_exposition_is_a_plain_histogram_s():
    plain_reg, plain, queued_reg, queued = _pair(())
    for v in VALUES:
        plain.observe(v)
        queued.observe(v)
    assert _exposition(queued_reg) == _exposition(plain_reg)
    queued.observe(0.002)                        # queued after a scrape: the next one has it
    plain.observe(0.002)
    assert _exposition(queued_reg) == _exposition(plain_reg)


def test_labelled_observations_go_to_their_label():
    plain_reg, plain, queued_reg, queued = _pair(("worker",))
    for i, v in enumerate(VALUES):
        w = f"10.0.0.{i % 3}:50061"
        plain.labels(w).observe(v)
        queued.observe(v, w)
    assert _exposition(queued_reg) == _exposition(plain_reg)
    assert any('worker="10.0.0.2:50061"' in line for line in _exposition(queued_reg))


def test_threads_lose_nothing_and_the_queue_is_taken_in_without_a_scrape():
    _, _, _, queued = _pair(())
    per, threads = 5000, 4

    def observe() -> None:
        for _ in range(per):
            queued.observe(0.001)

    ts = [threading.Thread(target=observe) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    deadline = time.monotonic() + 10 * QueuedHistogram.FOLD_EVERY_S
    while queued._queued and time.monotonic() < deadline:          # the metrics-fold thread takes them in
        time.sleep(0.05)
    assert not queued._queued, "no thread took the queue in"
    assert any(t.name == "metrics-fold" for t in threading.enumerate())
    samples = {s.name: s.value for f in queued.collect() for s in f.samples}
    assert samples["t_seconds_count"] == per * threads


def test_past_its_cap_the_queue_is_taken_in_by_the_hot_path(monkeypatch):
    monkeypatch.setattr(QueuedHistogram, "CAP", 100)
    monkeypatch.setattr(QueuedHistogram, "FOLD_EVERY_S", 3600.0)   # (a thread already running keeps its period)
    _, _, _, queued = _pair(())
    for _ in range(1000):
        queued.observe(0.5)
    assert len(queued._queued) <= 100 + QueuedHistogram.CHUNK
    assert {s.name: s.value for f in queued.collect() for s in f.samples}["t_seconds_count"] == 1000
