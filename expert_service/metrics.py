"""An expert worker's own metrics (`colibri expert --metrics-port P`): what it computes and what it holds.

- colibri:expert_compute_seconds (histogram): one Forward's fused-MoE compute.
- colibri:expert_tokens_total: token rows computed; colibri:expert_forward_total{code}: calls by outcome;
  colibri:expert_native_answers_total: those of them the native door answered (a CPU worker's same-host socket).
- colibri:expert_resident_bytes: bytes of packed expert weights held; colibri:expert_in_place_bytes: bytes of
  experts computed where they lie in the mapped checkpoint (page cache, shared); colibri:expert_streams_open.
- colibri:checkpoint_resident_bytes{page="2MiB"|"4KiB"}: the worker's mapping of the checkpoint, resident, by page
  size (/proc/self/smaps, read at most every 30 s): in-place experts stream faster from 2 MiB pages
  (`docs/operations.md`, Memory).
- With a bounded expert cache: colibri:expert_cache_{hits,misses,evictions}_total,
  colibri:expert_cache_prefetch_{packed,used,wasted}_total (experts packed ahead on the router's prediction,
  then hit or evicted unused), colibri:expert_cache_resident_bytes{tier="hot"|"warm"|"mapped"},
  colibri:expert_cache_hit_rate_1m and colibri:expert_cache_slots.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from colibri_common import page_cache
from colibri_common.metrics_http import TOKEN_BUCKETS, QueuedHistogram, render, serve_metrics, with_process
from kernels import native_door

PAGES_EVERY = 30.0        # seconds between two reads of /proc/self/smaps for colibri:checkpoint_resident_bytes


class WorkerMetrics:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tokens = 0
        self.calls = {"ok": 0, "invalid_argument": 0, "internal": 0, "unavailable": 0, "failed_precondition": 0}
        self.resident_bytes = 0
        self.cache = None          # the shard's ExpertCache, when its capacity is bounded
        self.mapped_bytes = 0      # the shard's experts in the checkpoint files (the cold tier)
        self.in_place_bytes = 0    # the shard's experts computed in place on the mapping (0 when packed)
        self.streams_open = 0
        self.local_open: Callable[[], int] = lambda: 0   # the same-host socket's connections open now
        self.mapped_files: list[Path] = []   # the checkpoint files read through the mapping (in place, or the
        #                                      expert cache's mapped tier; none when all packed)
        self._pages: tuple[float, tuple[int, int] | None] = (float("-inf"), None)   # (when, mapped_pages)
        self.registry = with_process(CollectorRegistry(auto_describe=False))
        self.compute = QueuedHistogram(Histogram("colibri:expert_compute_seconds", "One Forward's fused-MoE compute.",
                                                 buckets=TOKEN_BUCKETS, registry=None))
        self.door: Callable[[], native_door.DoorStats] | None = None   # the native door's calls (door.py)
        self.registry.register(self)

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        door = None if self.door is None else self.door()
        for family in self.compute.collect():
            yield family if door is None else _with_door(family, door)
        with self.lock:
            yield CounterMetricFamily("colibri:expert_tokens", "Token rows computed.",
                                      value=self.tokens + (door.rows if door else 0))
            calls = CounterMetricFamily("colibri:expert_forward", "Forward calls (unary or stream messages) by "
                                        "outcome.", labels=["code"])
            for code, n in self.calls.items():
                calls.add_metric([code], n + (door.calls if door and code == "ok" else 0))
            yield calls
            if door is not None:
                yield CounterMetricFamily("colibri:expert_native_answers", "Forward calls of the same-host socket "
                                          "answered in native code (the door; counted in expert_forward_total "
                                          "too).", value=door.calls)
            resident = self.resident_bytes if self.cache is None else sum(self.cache.resident_bytes.values())
            yield GaugeMetricFamily("colibri:expert_resident_bytes", "Bytes of packed expert weights held.",
                                    value=resident)
            yield GaugeMetricFamily("colibri:expert_in_place_bytes", "Bytes of experts computed where they lie in "
                                    "the mapped checkpoint (the page cache's pages, shared; none packed).",
                                    value=self.in_place_bytes)
            yield GaugeMetricFamily("colibri:expert_streams_open", "ForwardStream calls open.",
                                    value=self.streams_open)
            yield GaugeMetricFamily("colibri:expert_local_connections_open", "Same-host socket connections open "
                                    "(a router on this host sends its layers there, not over ForwardStream).",
                                    value=self.local_open())
        if self.cache is not None:
            yield from self._cache_families()
        pages = self.checkpoint_pages()
        if pages is not None:
            by_page = GaugeMetricFamily("colibri:checkpoint_resident_bytes", "Bytes of this worker's mapping of the "
                                        "checkpoint in memory, by page size (2MiB: PMD-mapped on x86-64; in-place "
                                        "experts stream faster from them).", labels=["page"])
            by_page.add_metric(["2MiB"], pages[1])
            by_page.add_metric(["4KiB"], pages[0] - pages[1])
            yield by_page

    def checkpoint_pages(self) -> tuple[int, int] | None:
        """The mapping's (resident, 2 MiB-page) bytes, read from smaps at most every PAGES_EVERY seconds: the kernel
        walks every resident mapping's page tables to write smaps, under the lock the allocator's mmap takes."""
        at, pages = self._pages
        if not self.mapped_files:
            return None
        if time.monotonic() - at >= PAGES_EVERY:
            pages = page_cache.mapped_pages(self.mapped_files)
            self._pages = (time.monotonic(), pages)
        return pages

    def _cache_families(self) -> Iterator[Metric]:
        c = self.cache
        st = c.stats
        for name, value, text in (
                ("hits", st.hits, "Expert lookups found hot (packed)."),
                ("misses", st.misses, "Expert lookups that packed the expert from the checkpoint."),
                ("evictions", st.evictions, "Hot experts evicted to make room."),
                ("prefetch_packed", st.prefetched, "Experts packed ahead on the router's prediction."),
                ("prefetch_used", st.prefetch_used, "Prefetched experts hit before they were evicted."),
                ("prefetch_wasted", st.prefetch_wasted, "Prefetched experts evicted without a hit.")):
            yield CounterMetricFamily(f"colibri:expert_cache_{name}", text, value=value)
        tiers = GaugeMetricFamily("colibri:expert_cache_resident_bytes", "Bytes of experts per tier: packed hot, "
                                  "pinned host (warm, GPU workers), and mapped from the checkpoint.", labels=["tier"])
        for tier, n in c.resident_bytes.items():
            tiers.add_metric([tier], n)
        tiers.add_metric(["mapped"], self.mapped_bytes)
        yield tiers
        yield GaugeMetricFamily("colibri:expert_cache_hit_rate_1m", "Hits ÷ lookups over the last minute.",
                                value=st.hit_rate_last_minute())
        yield GaugeMetricFamily("colibri:expert_cache_slots", "Hot slots of the expert cache.",
                                value=c.hot.w13.shape[0])

    def count(self, code: str, rows: int = 0, seconds: float | None = None) -> None:
        with self.lock:
            self.calls[code] += 1
            self.tokens += rows
        if seconds is not None:
            self.compute.observe(seconds)

    def serve(self, host: str, port: int) -> int:
        return serve_metrics(host, port, lambda: render(self.registry))


def _with_door(family: Metric, door: native_door.DoorStats) -> Metric:
    """The compute histogram with the door's calls added: its bucket counts (cumulative, as exposed), count and sum."""
    cumulative = list(itertools.accumulate(door.counts))
    samples = []
    for sample in family.samples:
        if sample.name.endswith("_bucket"):
            le = float(sample.labels["le"])
            i = len(TOKEN_BUCKETS) if le == math.inf else TOKEN_BUCKETS.index(le)
            sample = sample._replace(value=sample.value + cumulative[i])
        elif sample.name.endswith("_count"):
            sample = sample._replace(value=sample.value + door.calls)
        elif sample.name.endswith("_sum"):
            sample = sample._replace(value=sample.value + door.seconds)
        samples.append(sample)
    family.samples = samples
    return family
