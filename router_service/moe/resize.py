"""The router's placement owner: resize the worker set and re-balance experts while serving.

A change (`set_workers`, `rebalance`) runs on the caller's thread, one at a time:

1. **plan**: the new workers are connected and described; the experts are placed evenly, or by measured
   load with redundant replicas of the hottest (`plan.py`), under a new epoch;
2. **load**: every worker of the new plan is assigned its old experts *and* its new ones (so it answers both
   epochs) and maps or packs what it lacks, while the old plan keeps serving;
3. **switch**: between two steps (`RemoteExperts.switch`), the dispatch moves to the new plan;
4. **release**: every worker is assigned exactly its new experts; removed ones are assigned none (their
   memory is returned) and their connections closed. The step in flight at the switch ended before it, so a
   removed worker is drained when it is released.

A worker that cannot load (unreachable, killed, out of memory, a refusal) rolls the change back: the workers
that loaded go back to their old experts, the old plan never stopped serving, and the caller gets the
reason. No request fails and no token changes: the sum is the same whatever worker computes a pair.

A worker that failed a call or came back is re-synced by upkeep.py, which also runs the periodic rebalance and
plans out workers lost for good.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from colibri_common.errors import ConfigError
from router_service.moe.admission import WorkerInfo
from router_service.moe.follow import Follower, resolve
from router_service.moe.heartbeat import LOAD_SILENCE_S
from router_service.moe.plan import Held, Plan, ResizeFailed, balance, load_plan, sticky_plan, union
from router_service.moe.release import RETRY_S as LATE_RETRY_S
from router_service.moe.release import LateRelease
from router_service.moe.remote import RemoteExperts
from router_service.moe.table import Table
from router_service.moe.transport import WorkerError
from router_service.moe.upkeep import Upkeep

log = logging.getLogger("colibri.router")
RELEASE_TIMEOUT_S = 30.0      # dropping experts takes no loading; a worker being released may be gone already


@dataclass(frozen=True)
class PlacementOptions:
    replicas: int = 1                 # each expert on this many workers (a plan of the router's)
    redundant_experts: int = 0        # per layer, this many hottest experts get one more replica
    rebalance_interval: float = 0.0   # seconds between re-plans from load; 0 = only when asked
    load_timeout: float = 600.0       # seconds a worker may take to load its new experts
    connect_timeout: float = 10.0     # seconds a new worker may take to answer Describe
    replan_dead_after: float = 0.0    # a worker down this long is planned out (its experts moved); 0 = never
    load_silence: float = LOAD_SILENCE_S   # a worker loading or releasing that answers no check this long fails

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, got {self.replicas}")
        if self.redundant_experts < 0:
            raise ValueError(f"--redundant-experts must be >= 0, got {self.redundant_experts}")
        if self.rebalance_interval < 0:
            raise ValueError(f"--rebalance-interval must be >= 0 (0 = off), got {self.rebalance_interval}")
        if self.load_silence <= 0:
            raise ValueError(f"the load silence must be > 0 seconds, got {self.load_silence}")
        if self.replan_dead_after < 0:
            raise ValueError(f"--replan-dead-after must be >= 0 (0 = off), got {self.replan_dead_after}")


@dataclass(frozen=True)
class Outcome:
    """What a change did."""

    changed: bool
    epoch: int
    seconds: float                    # from the start to the switch
    balance_before: float             # expected balance (mean ÷ max load) of the old and new plan, by the window
    balance_after: float
    message: str


class Placement:
    def __init__(self, remote: RemoteExperts, opts: PlacementOptions | None = None) -> None:
        self.remote, self.opts = remote, opts or PlacementOptions()
        self.cfg = remote.cfg
        self.next_epoch = remote.table.epoch + 1
        self.change_lock = threading.Lock()             # one change at a time
        self.last: Outcome | None = None
        self.cordoned: set[str] = set()                 # removed by an operator: --follow-workers leaves them out
        self.follower: Follower | None = None
        self.upkeep = Upkeep(self)                      # re-syncs, periodic rebalances, dead workers planned out
        self.late = LateRelease(remote)                 # removed workers that did not confirm their release

    # -- plans -------------------------------------------------------------------------------------
    def _load(self) -> dict[int, list[float]]:
        totals = self.remote.window.totals()                                   # [L, E]
        return {layer: [float(c) for c in totals[layer].tolist()] for layer in self.cfg.moe_layers}

    def _measured(self) -> bool:
        return bool(self.remote.window.totals().sum() > 0)

    def _held(self, workers: tuple[str, ...], budgets: dict[str, int]) -> Held:
        E, layers, r = self.cfg.num_experts, self.cfg.moe_layers, self.opts.replicas
        if len(workers) > E:
            raise ResizeFailed(f"{len(workers)} workers for {E} experts a layer: every worker needs at least one; "
                               f"list at most {E}")
        if self._measured() or any(budgets.values()):
            try:
                return load_plan(self._load(), workers, r, self.opts.redundant_experts, budgets)
            except ValueError as exc:
                raise ResizeFailed(str(exc)) from exc
        return sticky_plan(self.remote.table.plan.held, E, layers, workers, r)

    # -- changes -----------------------------------------------------------------------------------
    def set_workers(self, addresses: tuple[str, ...] = (), by_operator: bool = True, add: tuple[str, ...] = (),
                    remove: tuple[str, ...] = (), wanted: Callable[[], bool] = lambda: True) -> Outcome:
        """Serve with exactly `addresses` (or the current set with `add` joined and `remove` taken out, as it is
        when this change's turn comes) from a switch between two steps on; raises ResizeFailed (nothing changed)
        with the reason. Workers an operator removes are not taken back by `--follow-workers` while they are
        still listed there (draining). `wanted`: asked when the change's turn comes (another may be under way):
        an operator's call that has given up by then (its deadline passed) changes nothing."""
        if addresses and (add or remove):
            raise ResizeFailed("give the whole set of workers, or workers to add and remove, not both")
        if set(add) & set(remove):
            raise ResizeFailed(f"{', '.join(sorted(set(add) & set(remove)))}: both added and removed")
        if max(len(addresses), len(add)) > self.cfg.num_experts:
            raise ResizeFailed(f"more workers than the {self.cfg.num_experts} experts a layer: every worker needs "
                               f"at least one")
        if by_operator and self.follower is not None:
            self._check_followed((*addresses, *add))
        with self.change_lock:
            _still(wanted)
            old = self.remote.table.plan.workers
            lost = self.remote.lost
            if not addresses and by_operator and remove and not add and all(a in lost for a in remove):
                for a in remove:            # planned out while down: it holds nothing, the router forgets it
                    lost.pop(a, None)
                b = self.remote.window.balance(old)
                return Outcome(False, self.remote.table.epoch, 0.0, b, b,
                               f"{', '.join(remove)}: planned out while down (--replan-dead-after), so it held no "
                               f"experts; forgotten (no longer shown)")
            if not addresses:
                unknown = [a for a in remove if a not in old]
                if unknown:
                    raise ResizeFailed(f"{', '.join(unknown)}: not among the router's workers ({', '.join(old)})")
                known = [a for a in add if a in old]        # adding one again re-planned the same workers
                if known:
                    raise ResizeFailed(f"{', '.join(known)}: already among the router's workers ({', '.join(old)}); "
                                       f"`colibri workers rebalance` re-plans from the load")
                addresses = tuple(a for a in (*old, *add) if a not in remove)
                addresses = tuple(dict.fromkeys(addresses))
            if not addresses:
                raise ResizeFailed("a router serves with at least one worker: this change would leave it none")
            if len(set(addresses)) != len(addresses):
                raise ResizeFailed(f"a worker is listed twice: {', '.join(addresses)}")
            out = self._change_to(tuple(addresses), "resize")
            for a in [a for a in list(lost) if a in addresses or (by_operator and not add and not remove)]:
                lost.pop(a, None)           # planned in again, or the operator has set the workers by hand
            if by_operator:
                self.cordoned = (self.cordoned | {a for a in old if a not in addresses}) - set(addresses)
            return out

    def _check_followed(self, asked: tuple[str, ...]) -> None:
        """A router that follows a name serves what it resolves to: an operator may take workers out (cordon them)
        but not bring in one the name lacks, which the next poll took out again (the change had said it was done)."""
        assert self.follower is not None
        named = resolve(self.follower.target)
        alien = [a for a in asked if a not in named and a not in self.remote.table.plan.workers]
        if alien:
            raise ResizeFailed(f"{', '.join(alien)}: this router follows {self.follower.target} (--follow-workers) "
                               f"and serves what it resolves to ({', '.join(named) or 'nothing now'}); put the "
                               f"worker behind that name (scale the StatefulSet), or start the router with "
                               f"--workers to choose them by hand")

    def follow(self, target: str, interval_s: float = 5.0) -> None:
        """Serve with the workers `target` (NAME:PORT) resolves to, re-planning when they change."""
        def change(workers: tuple[str, ...]) -> None:
            try:
                self.set_workers(workers, by_operator=False)
            except ResizeFailed as exc:
                log.warning("following %s: %s", target, exc)

        def uncordon(gone: set[str]) -> None:
            self.cordoned = self.cordoned - gone

        self.follower = Follower(target, lambda: self.remote.table.plan.workers, change, lambda: set(self.cordoned),
                                 uncordon, interval_s)

    def rebalance(self, wanted: Callable[[], bool] = lambda: True) -> Outcome:
        """Re-plan the same workers from the measured load (EPLB); no change when it would not help (`wanted`: as
        set_workers)."""
        with self.change_lock:
            _still(wanted)
            return self._change_to(self.remote.table.plan.workers, "rebalance")

    def _connect(self, addresses: tuple[str, ...]) -> dict[str, WorkerInfo]:
        remote, old = self.remote, self.remote.table.plan
        infos: dict[str, WorkerInfo] = {}
        deadline = time.monotonic() + self.opts.connect_timeout

        def one(a: str) -> WorkerInfo:
            remote.add_worker(a)
            info = remote.describe(a, deadline)
            remote.liveness.set_healthy({remote.index[a]: True})    # it answers (one frozen has not got here)
            return info

        fresh = [a for a in addresses if a not in old.workers]
        with ThreadPoolExecutor(max(1, min(32, len(fresh)))) as pool:
            futures = {a: pool.submit(one, a) for a in fresh}
        for a, f in futures.items():
            try:
                infos[a] = f.result()
            except (WorkerError, ConfigError, ValueError) as exc:
                for b in fresh:
                    self._drop_link(b)
                raise ResizeFailed(f"worker {a} cannot join: {exc}") from exc
        instances = [infos[a].instance for a in fresh if infos[a].instance]
        if len(set(instances)) != len(instances):
            for b in fresh:
                self._drop_link(b)
            raise ResizeFailed("two of the new addresses reach the same expert worker; list each worker once")
        for a in addresses:
            if a not in infos:
                infos[a] = WorkerInfo(a, old.epoch, old.of(a), (), remote.budgets.get(a, 0), False, "")
        return infos

    def _drop_link(self, address: str) -> None:
        w = self.remote.index.get(address)
        if w is not None and not self.remote.table.in_plan(w):
            self.remote.links.links[w].close()
            self.remote.liveness.set_synced(w, True)     # a clean slate if it is ever added again
            self.remote.liveness.forgive(w)

    def _change_to(self, addresses: tuple[str, ...], what: str) -> Outcome:
        t0 = time.perf_counter()
        remote = self.remote
        old = remote.table.plan
        if len(addresses) > self.cfg.num_experts:
            raise ResizeFailed(f"{len(addresses)} workers for {self.cfg.num_experts} experts a layer: every worker "
                               f"needs at least one; list at most {self.cfg.num_experts}")
        infos = self._connect(addresses)
        budgets = {a: i.max_experts for a, i in infos.items()}
        held = self._held(addresses, budgets)
        load = self._load()
        before, after = balance(old.held, load), balance(held, load)
        if addresses == old.workers and held == old.held:
            return Outcome(False, old.epoch, 0.0, before, after, f"the {what} changes nothing: the plan is the same")
        if set(addresses) == set(old.workers) and after < before + 0.02:
            return Outcome(False, old.epoch, 0.0, before, after, f"no {what}: the same workers, and the expected "
                           f"balance would go from {before:.3f} to {after:.3f}")
        epoch = max(self.next_epoch, old.epoch + 1, *(i.epoch + 1 for i in infos.values()))
        self.next_epoch = epoch + 1
        plan = Plan(epoch, addresses, held)
        log.info("%s to placement epoch %d: workers %s (expected balance %.3f -> %.3f)", what, epoch,
                 ", ".join(addresses), before, after)
        if not remote.table.explicit:
            # a static plan sends each token's whole top-k to its owners, who compute whatever they hold: while
            # they hold old and new experts together, each must be told its own pairs
            try:
                remote.switch(dataclasses.replace(remote.table, explicit=True))
            except WorkerError as exc:
                remote.cancel_switch()
                raise ResizeFailed(f"{what} not begun: {exc}") from exc
        # 2. load: every new owner holds old ∪ new and answers both epochs
        loaded: list[str] = []
        errors: list[str] = []
        with ThreadPoolExecutor(len(addresses)) as pool:
            futures = {a: pool.submit(remote.assign, a, union(old.of(a), plan.of(a)), epoch, self.opts.load_timeout,
                                      (old.epoch,), True, True, self.opts.load_silence) for a in addresses}
            for a, f in futures.items():
                try:
                    f.result()
                    loaded.append(a)
                except WorkerError as exc:
                    errors.append(str(exc))
        if errors:
            self._roll_back(old, loaded, epoch)
            raise ResizeFailed(f"{what} rolled back, the old placement (epoch {old.epoch}) serves on: "
                               + "; ".join(errors))
        # 3. switch between two steps
        try:
            remote.switch(Table.of(plan, remote.index, self.cfg.num_layers, self.cfg.num_experts))
        except WorkerError as exc:                # the engine never reached the end of a step
            self._roll_back(old, loaded, epoch)
            raise ResizeFailed(f"{what} rolled back: {exc}") from exc
        seconds = time.perf_counter() - t0
        remote.rebalances += 1
        remote.rebalance_seconds += seconds
        for a in addresses:                       # they hold this plan: no re-sync pending, no ban from before
            remote.liveness.set_synced(remote.index[a], True)
        # 4. release: exactly the new experts; removed workers none (they may be gone: no waiting for them)
        release = (*addresses, *(a for a in old.workers if a not in addresses))
        unanswered: dict[str, str] = {}
        with ThreadPoolExecutor(len(release)) as pool:
            futures = {a: pool.submit(remote.assign, a, plan.of(a), epoch, RELEASE_TIMEOUT_S, (), False, False,
                                      self.opts.load_silence) for a in release}
            for a, f in futures.items():
                try:
                    f.result()
                except WorkerError as exc:     # it holds more than it needs (harmless) or it is gone
                    unanswered[a] = str(exc)
                    if a in addresses:
                        log.warning("placement epoch %d: %s kept its previous experts: %s", epoch, a, exc)
        for a in old.workers:
            if a not in addresses:
                self._drop_link(a)
                if a in unanswered:            # out of the plan all the same: no step sends it anything
                    log.warning("worker %s is out of the plan (drained) but did not confirm its release, so it may "
                                "still hold its experts' memory until it answers (asked again every %.0f s) or "
                                "restarts: %s", a, LATE_RETRY_S, unanswered[a])
                    self.late.ask_again(a, epoch)
                else:
                    log.info("worker %s released (drained, no experts held)", a)
        message = (f"placement epoch {epoch}: {len(addresses)} workers, switched {seconds:.2f}s after the {what} "
                   f"began; expected balance {before:.3f} -> {after:.3f}")
        if unanswered:                            # the operator sees it where the change is reported, not only here
            said = [f"{a} ({'in the plan' if a in addresses else 'out of the plan'}: {why})"
                    for a, why in unanswered.items()]
            message += "; the release went unanswered by " + "; ".join(said)
        log.info(message)
        self.last = Outcome(True, epoch, seconds, before, after, message)
        return self.last

    def _roll_back(self, old: Plan, loaded: list[str], epoch: int) -> None:
        remote = self.remote
        remote.cancel_switch()
        for a in loaded:
            try:
                if a in old.workers:
                    remote.assign(a, old.of(a), epoch, RELEASE_TIMEOUT_S, (old.epoch,), False, False,
                                  self.opts.load_silence)
                else:
                    remote.assign(a, {}, epoch, RELEASE_TIMEOUT_S, (), False, False, self.opts.load_silence)
            except WorkerError as exc:
                log.warning("rolling back placement epoch %d: %s: %s", epoch, a, exc)
        for a in loaded:
            if a not in old.workers:
                self._drop_link(a)
        log.warning("placement epoch %d rolled back; epoch %d serves on", epoch, old.epoch)

    def close(self) -> None:
        self.upkeep.close()
        self.late.close()
        if self.follower is not None:
            self.follower.close()


def _still(wanted: Callable[[], bool]) -> None:
    if not wanted():
        raise ResizeFailed("the caller gave up (its deadline passed or it was cancelled) before this change's turn "
                           "came, behind another change: nothing changed")
