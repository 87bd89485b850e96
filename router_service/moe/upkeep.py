"""The router's upkeep of its placement, on threads of their own (resize.py makes the changes):

- **re-sync**: a worker that failed a call, or whose health checks pass again, is described before it is sent
  tokens; one that does not hold the current plan (restarted empty, or on another epoch) is assigned its experts
  again. A worker holding another router's newer plan is not taken back (one router owns a fleet's placement):
  the log says so and it stays out.
- **rebalance** every `--rebalance-interval` seconds, from the measured load;
- **plan out the dead**: a worker whose health checks have failed for `--replan-dead-after` seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

from router_service.moe.admission import serves
from router_service.moe.plan import ResizeFailed
from router_service.moe.remote import RemoteExperts
from router_service.moe.transport import WorkerError


class Options(Protocol):
    rebalance_interval: float
    replan_dead_after: float
    load_timeout: float
    load_silence: float


class Changed(Protocol):
    changed: bool
    message: str


class Changes(Protocol):
    """What the upkeep needs of the placement owner (resize.Placement)."""

    remote: RemoteExperts
    opts: Options
    change_lock: threading.Lock

    def rebalance(self) -> Changed: ...

    def set_workers(self, addresses: tuple[str, ...] = (), by_operator: bool = True) -> Changed: ...

log = logging.getLogger("colibri.router")


class Upkeep:
    def __init__(self, placement: Changes) -> None:
        self.placement = placement
        self._resyncing: set[int] = set()
        self._wake: dict[int, threading.Event] = {}   # a re-sync waiting to try again: asked again, it tries now
        self._asked: dict[int, int] = {}        # re-syncs asked per worker: a thread whose Describe predates the
        self._resync_lock = threading.Lock()    # last ask (a restart since) must describe again
        self._stop = threading.Event()
        placement.remote.on_failure = self.resync
        placement.remote.on_back = self.resync
        if placement.opts.rebalance_interval > 0:
            threading.Thread(target=self._rebalancing, name="rebalance", daemon=True).start()
        if placement.opts.replan_dead_after > 0:
            threading.Thread(target=self._planning_out_the_dead, name="replan-dead", daemon=True).start()

    def resync(self, w: int) -> None:
        """Worker w failed a call, or its health checks pass again: before it is sent tokens it must hold the
        current plan's experts."""
        self.placement.remote.kept_out.discard(w)   # a new ask: what refused before may be gone
        with self._resync_lock:                # never the change lock: this runs on the engine's thread
            self._asked[w] = self._asked.get(w, 0) + 1
            if w in self._resyncing:           # its health checks pass again, say: the waiting re-sync tries now
                self._wake.setdefault(w, threading.Event()).set()
                return
            if not self.placement.remote.table.in_plan(w):
                return
            self._resyncing.add(w)
        self.placement.remote.liveness.set_synced(w, False)
        threading.Thread(target=self._resync, args=(w,), name="resync", daemon=True).start()

    def _resync(self, w: int) -> None:
        remote, address = self.placement.remote, self.placement.remote.addresses[w]
        pause = 0.1
        warned = [""]                                    # the last reason logged: each new one once
        with self._resync_lock:
            wake = self._wake.setdefault(w, threading.Event())
        try:
            while not self._stop.is_set():
                wake.clear()
                with self._resync_lock:
                    asked = self._asked.get(w, 0)
                try:
                    if self._resync_once(w, address, warned, asked):
                        with self._resync_lock:             # asked again since (a restart): describe it again
                            if self._asked.get(w, 0) == asked:
                                self._resyncing.discard(w)
                                return
                        continue
                except Exception:  # noqa: BLE001 (logged; the loop tries again, a thread's traceback would end it)
                    if self._stop.is_set() or remote.links.links[w].closed:
                        return                              # the router is stopping: its links closed under us
                    log.exception("re-sync of %s failed; trying again", address)
                wake.wait(pause)               # a worker back (its health checks pass) is described at once
                pause = min(2.0, pause * 2)
        finally:
            with self._resync_lock:
                self._resyncing.discard(w)
            if not remote.table.in_plan(w):
                remote.liveness.set_synced(w, True)     # it left the plan: a clean slate if it comes back

    def _kept_out(self, w: int, address: str, why: str, warned: list[str]) -> bool:
        """Log once why a worker stays out (a refusal such as another --quantize, token or checkpoint is a
        WARNING an operator must see: it was DEBUG, and the worker looked healthy yet unused); False. A layer
        waiting on its re-sync stops waiting."""
        self.placement.remote.kept_out.add(w)
        if why != warned[0]:
            log.warning("expert worker %s stays out of the placement until this changes: %s", address, why)
            warned[0] = why
        return False

    def _resync_once(self, w: int, address: str, warned: list[str], asked: int) -> bool:
        """One try at having worker w hold the current plan's experts (`asked`: the re-syncs asked before it);
        True when it does (or left the plan)."""
        remote = self.placement.remote
        try:
            info = remote.describe(address, time.monotonic() + 2.0)      # outside the change lock
        except WorkerError as exc:
            if exc.retryable:                            # down or starting: the health checks say so
                log.debug("re-sync of %s: %s", address, exc)
                return False
            return self._kept_out(w, address, str(exc), warned)
        with self.placement.change_lock:
            table = remote.table
            if not table.in_plan(w):
                return True
            with self._resync_lock:
                if self._asked.get(w, 0) != asked:       # asked again since that Describe: a newer process
                    return False
            if serves(info, table):
                self._synced(w, info.instance)
                return True
            mine = info.owner in ("", remote.owner_id)
            if info.epoch > table.epoch and not mine:
                remote.kept_out.add(w)
                if warned[0] != info.owner:
                    log.error("worker %s holds placement epoch %d of another router (%s): this router (epoch %d) "
                              "cannot serve with it; one router owns a fleet's placement", address, info.epoch,
                              info.owner, table.epoch)
                    warned[0] = info.owner
                return False
            # never lower a worker's epoch (after this router's rollback it is ahead): it answers for ours too
            epoch = max(table.epoch, info.epoch)
            try:
                opts = self.placement.opts
                remote.assign(address, table.plan.of(address), epoch, opts.load_timeout,
                              (table.epoch,) if epoch != table.epoch else (), silence_s=opts.load_silence)
            except WorkerError as exc:
                return self._kept_out(w, address, f"it did not take its experts: {exc}", warned)
            log.info("worker %s re-synced to placement epoch %d (it held epoch %d)", address, table.epoch, info.epoch)
            self._synced(w, info.instance)
            return True

    def _synced(self, w: int, process: str) -> None:
        """Worker w (answering from `process`) holds the current plan: it may be sent tokens again (a ban on a
        process that has since died ends now)."""
        self.placement.remote.kept_out.discard(w)
        self.placement.remote.liveness.set_synced(w, True)
        self.placement.remote.liveness.restarted(w, process)

    def _rebalancing(self) -> None:
        while not self._stop.wait(self.placement.opts.rebalance_interval):
            try:
                out = self.placement.rebalance()
                if not out.changed:
                    log.debug(out.message)
            except ResizeFailed as exc:
                log.warning("periodic rebalance: %s", exc)
            except Exception:  # noqa: BLE001 (the thread goes on; the next interval tries again)
                log.exception("periodic rebalance failed")

    def _planning_out_the_dead(self) -> None:
        """A worker whose health checks have failed for --replan-dead-after seconds is planned out: its experts
        move to the living (a rank lost for good stops failing requests; with --follow-workers it is planned in
        again when it serves again)."""
        down_since: dict[str, float] = {}
        not_before = 0.0                                # after a failed attempt, the next one waits a while
        while not self._stop.wait(0.5):
            remote = self.placement.remote
            plan = remote.table.plan
            now = time.monotonic()
            for address in plan.workers:
                w = remote.index[address]
                if remote.liveness.healthy[w]:
                    down_since.pop(address, None)
                else:
                    down_since.setdefault(address, now)
            after = self.placement.opts.replan_dead_after
            dead = tuple(a for a in plan.workers if now - down_since.get(a, now) >= after)
            alive = tuple(a for a in plan.workers if a not in dead)
            if not dead or not alive or now < not_before:
                continue
            log.warning("worker%s %s down for %.0fs or more: moving %s experts to %s", "s" * (len(dead) > 1),
                        ", ".join(dead), self.placement.opts.replan_dead_after, "their" if len(dead) > 1 else "its",
                        ", ".join(alive))
            try:
                self.placement.set_workers(alive, by_operator=False)
                for a in dead:
                    down_since.pop(a, None)
                    remote.lost[a] = time.time()
                remote.planned_out_dead += len(dead)
            except ResizeFailed as exc:
                log.warning("planning out %s: %s (trying again in 10s)", ", ".join(dead), exc)
                not_before = time.monotonic() + 10.0

    def close(self) -> None:
        self._stop.set()
