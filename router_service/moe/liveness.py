"""Which workers the router sends to: up by their health checks, and not banned after a failed call.

A worker whose call fails is banned at once, for a backoff that doubles on each failure (0.5 s up to 30 s)
and resets after a minute without one; it is re-admitted when the ban has passed and its health checks say
SERVING again (log line, `colibri:worker_readmissions_total`). Plain Python; the health checks are
`worker_watch.WorkerWatch`'s.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("colibri.router")


class Liveness:
    FIRST_BAN_S = 0.5
    MAX_BAN_S = 30.0
    FORGIVE_S = 60.0

    def __init__(self, addresses: tuple[str, ...]) -> None:
        self.addresses = addresses
        self.healthy = [True] * len(addresses)        # from the health checks
        self.banned_until = [0.0] * len(addresses)
        self.ban_s = [0.0] * len(addresses)
        self.last_failure = [0.0] * len(addresses)
        self.bans = [0] * len(addresses)
        self.readmissions = [0] * len(addresses)
        self._was_live = [True] * len(addresses)
        self._lock = threading.Lock()

    def live(self) -> list[bool]:
        now = time.monotonic()
        with self._lock:
            out = [h and now >= b for h, b in zip(self.healthy, self.banned_until, strict=True)]
            for w, (was, is_) in enumerate(zip(self._was_live, out, strict=True)):
                if is_ and not was:
                    self.readmissions[w] += 1
                    log.info("expert worker %s is re-admitted (healthy, ban over)", self.addresses[w])
            self._was_live = out
        return out

    def failed(self, w: int, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            if now < self.banned_until[w]:       # the same incident (every reply in flight on it fails)
                return
            if now - self.last_failure[w] > self.FORGIVE_S:
                self.ban_s[w] = 0.0
            self.ban_s[w] = min(self.MAX_BAN_S, max(self.FIRST_BAN_S, 2 * self.ban_s[w]))
            self.banned_until[w] = now + self.ban_s[w]
            self.last_failure[w] = now
            self.bans[w] += 1
        log.warning("expert worker %s failed (%s): banned for %.1fs, its tokens go to replicas",
                    self.addresses[w], why, self.ban_s[w])

    def set_healthy(self, up: list[bool]) -> None:
        with self._lock:
            self.healthy = list(up)
