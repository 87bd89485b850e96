"""What an expert cache counts: hits, misses, evictions, prefetches used and wasted, and the hit rate of
the last minute (per-second buckets). Plain Python, no torch; the cache updates the counters under its
lock, and the window has a lock of its own, since the metrics thread reads it while calls count."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

WINDOW_S = 60


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    prefetched: int = 0           # experts packed ahead on a prediction
    prefetch_used: int = 0        # ... and hit before they were evicted
    prefetch_wasted: int = 0      # ... and evicted without a hit
    prefetch_hints: int = 0       # predictions received
    _window: deque[list[int]] = field(default_factory=deque)   # [second, hits, misses]
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def lookup(self, hit: bool, now: float | None = None) -> None:
        if hit:
            self.hits += 1
        else:
            self.misses += 1
        sec = int(time.monotonic() if now is None else now)
        with self._lock:
            if not self._window or self._window[-1][0] != sec:
                self._window.append([sec, 0, 0])
            self._window[-1][1 if hit else 2] += 1
            self._trim(sec)

    def _trim(self, sec: int) -> None:
        while self._window and self._window[0][0] <= sec - WINDOW_S:
            self._window.popleft()

    def hit_rate_last_minute(self, now: float | None = None) -> float:
        """Hits ÷ lookups over the last 60 s; 1.0 when there was no lookup (nothing missed)."""
        with self._lock:
            self._trim(int(time.monotonic() if now is None else now))
            hits = sum(b[1] for b in self._window)
            total = hits + sum(b[2] for b in self._window)
        return hits / total if total else 1.0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0
