"""Which workers the router sends to: up by their health checks, and not banned after a failed call.

A worker whose call fails is banned at once, for a backoff that doubles on each failure (0.5 s up to 30 s)
and resets after a minute without one; it is re-admitted when the ban has passed and its health checks say
SERVING again (log line, `colibri:worker_readmissions_total`), or as soon as another process at its address holds
the plan (`restarted`: the ban is on the process that failed). A worker down by its checks that still answers
a call (paused, then resumed) is alive: a layer that needs its experts alone waits for the checks to see it back
(`answering`, `await_live`) rather than failing its requests. Plain Python; the health checks are
`worker_watch.WorkerWatch`'s.
"""

from __future__ import annotations

import logging
import math
import threading
import time

log = logging.getLogger("colibri.router")


class Liveness:
    FIRST_BAN_S = 0.5
    MAX_BAN_S = 30.0
    FORGIVE_S = 60.0
    ANSWERED_RECENTLY_S = 1.0      # a down worker that answered a call this recently is waited for (answering)

    def __init__(self, addresses: tuple[str, ...]) -> None:
        self.addresses = addresses
        self.healthy = [True] * len(addresses)        # from the health checks
        self.banned_until = [0.0] * len(addresses)
        self.ban_s = [0.0] * len(addresses)
        self.last_failure = [0.0] * len(addresses)
        self.bans = [0] * len(addresses)
        self.readmissions = [0] * len(addresses)
        self._was_live = [True] * len(addresses)
        self.synced = [True] * len(addresses)         # holds the router's current plan (elastic placement)
        self.banned_process = [""] * len(addresses)   # the worker process (its instance) the ban is on
        self.answered_at: dict[int, float] = {}       # when a worker down by its checks last answered a call
        self.down_why: dict[int, str] = {}            # why a worker's checks last failed (worker_watch.WorkerWatch)
        self._lock = threading.Lock()

    def add(self, address: str) -> None:
        """One more worker (a resize), healthy and synced until found otherwise."""
        with self._lock:
            self.addresses = (*self.addresses, address)
            for name, value in (("healthy", True), ("banned_until", 0.0), ("ban_s", 0.0), ("last_failure", 0.0),
                                ("bans", 0), ("readmissions", 0), ("_was_live", True), ("synced", True),
                                ("banned_process", "")):
                getattr(self, name).append(value)

    def forgive(self, w: int) -> None:
        """Forget w's bans (it left the plan: if it is added again it starts clean)."""
        with self._lock:
            self.banned_until[w], self.ban_s[w] = 0.0, 0.0

    def set_synced(self, w: int, ok: bool) -> None:
        with self._lock:
            self.synced[w] = ok

    def why_not_live(self, w: int) -> str:
        """Why worker w is sent nothing now, in a few words (for an error that names it)."""
        with self._lock:
            if not self.healthy[w]:
                why = self.down_why.get(w, "")
                return "its health checks fail" + (f": {why}" if why else "")
            if time.monotonic() < self.banned_until[w]:
                return "a call to it failed just now"
            if not self.synced[w]:
                return "it does not hold this router's plan yet (being re-synced)"
            return "live"

    def live(self) -> list[bool]:
        now = time.monotonic()
        with self._lock:
            out = [h and now >= b and s for h, b, s in zip(self.healthy, self.banned_until, self.synced, strict=True)]
            for w, (was, is_) in enumerate(zip(self._was_live, out, strict=True)):
                if is_ and not was:
                    self.readmissions[w] += 1
                    log.info("expert worker %s is re-admitted (healthy, not banned, holding the plan)",
                             self.addresses[w])
            self._was_live = out
        return out

    def failed(self, w: int, why: str, process: str = "") -> None:
        """Worker w failed a call; `process`: the worker process (its instance) that was answering it."""
        now = time.monotonic()
        with self._lock:
            self.answered_at.pop(w, None)        # it answered before; now it fails: not waited for
            if now < self.banned_until[w]:       # the same incident (every reply in flight on it fails)
                return
            self.banned_process[w] = process
            if now - self.last_failure[w] > self.FORGIVE_S:
                self.ban_s[w] = 0.0
            self.ban_s[w] = min(self.MAX_BAN_S, max(self.FIRST_BAN_S, 2 * self.ban_s[w]))
            self.banned_until[w] = now + self.ban_s[w]
            self.last_failure[w] = now
            self.bans[w] += 1
        log.warning("expert worker %s failed (%s): left out for %.1fs; its experts' tokens go to their other "
                    "workers where they have any (--replicas), else their requests fail until it is back",
                    self.addresses[w], why, self.ban_s[w])

    def restarted(self, w: int, process: str) -> None:
        """Worker w now answers from `process` and holds the plan: a ban on another process (the one that died)
        ends at once, so the requests its experts serve succeed as soon as it is back (with one replica they
        failed until the ban ran out, up to 30 s after a crash loop). The next ban's length still doubles if the new
        process fails within the minute, but a crash loop is paced by its restarter's backoff, not by the bans."""
        with self._lock:
            if not process or not self.banned_process[w] or process == self.banned_process[w] or \
                    time.monotonic() >= self.banned_until[w]:
                return
            self.banned_until[w] = 0.0
        log.info("expert worker %s restarted (a new process holds its experts): its ban is lifted",
                 self.addresses[w])

    def answered(self, w: int) -> None:
        """Worker w answered a call while its health checks had it down: it is alive (it was paused, swapping or
        too busy to answer them), and the checks will see it back within a round or two."""
        self.answered_at[w] = time.monotonic()

    def answering(self, live: list[bool]) -> list[int]:
        """The workers not live in `live` that answered a call within ANSWERED_RECENTLY_S, are not banned (a failed
        call forgets the answer) and are down because their checks timed out: a worker that says NOT_SERVING
        (draining, stopping) is not waited for."""
        now = time.monotonic()
        with self._lock:
            return [w for w, ok in enumerate(live) if not ok and now - self.answered_at.get(w, -math.inf) <
                    self.ANSWERED_RECENTLY_S and now >= self.banned_until[w] and self.down_why.get(w, "")
                    .startswith("DEADLINE_EXCEEDED")]

    def await_live(self, workers: list[int], timeout_s: float) -> bool:
        """Whether every one of `workers` is live within `timeout_s` (polled: the health checks' thread and the
        re-sync set what `live` reads)."""
        deadline = time.monotonic() + timeout_s
        while True:
            live = self.live()
            if all(live[w] for w in workers):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)

    def set_healthy(self, up: dict[int, bool], why: dict[int, str] | None = None) -> None:
        """Health by worker index (the workers the watch checks; others keep theirs), and why the checks of those
        down failed."""
        with self._lock:
            for w, ok in up.items():
                self.healthy[w] = ok
            self.down_why.update(why or {})
