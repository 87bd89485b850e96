"""The experts a worker serves now, and the placement epochs they answer for: swapped whole when the router
assigns a new plan (`Assign`).

A call takes the shard it starts with (`use`) and keeps it to its end, so a swap never changes the experts
under a running call; a replaced shard is closed (its packed memory freed, its mappings unmapped) when its
last call ends. A call planned under an epoch the worker does not serve is refused: the router's pairs were
placed for a different set of experts, and computing them here would change the sum.

Where a native door answers the same-host socket's calls (expert_service/door.py, the `publisher`), each change is
published to it, and the shard it answers from counts as a use: a replaced shard is closed only once the door
answers from its successor.
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from typing import Protocol

from colibri_common.heap import return_free_heap
from colibri_common.placement import held_digest
from expert_service.build import BuiltShard
from expert_service.shard import ExpertShard

log = logging.getLogger("colibri.expert")


class WrongEpoch(Exception):
    """A Forward planned under a placement epoch this worker does not serve, or for other experts than it holds
    (FAILED_PRECONDITION: the router re-syncs it)."""


@dataclass(frozen=True)
class Served:
    """One shard, the epochs its experts answer for, and whose plan it is."""

    built: BuiltShard
    epoch: int                     # 0 = the worker's own static plan (--shard), before any Assign
    also: frozenset[int]           # earlier epochs the set still covers (the union during a switch)
    owner: str = ""                # the router whose plan this is ("" = the worker's own, or none)
    assigned: bool = True          # False: a worker without --shard that no router has given experts yet
    switching: bool = False        # the union of two plans (a change's load step), over budget until released

    def serves(self, epoch: int) -> bool:
        return self.assigned and (epoch == self.epoch or epoch in self.also)

    @functools.cached_property
    def digest(self) -> int:
        """held_digest of the experts held (what a whole-top-k call's `holds` must equal)."""
        return held_digest(self.built.experts.held)


class Publisher(Protocol):
    """Who answers calls outside the `use`s (expert_service/door.py): told each shard served, once it is."""

    def publish(self, served: Served | None) -> None: ...


class Holding:
    def __init__(self) -> None:
        self.now: Served | None = None
        self._users: dict[int, int] = {}          # id(BuiltShard) -> calls using it (and the publisher's one)
        self._retired: dict[int, BuiltShard] = {}  # replaced, closed when their last call ends
        self._lock = threading.Lock()
        self.publisher: Publisher | None = None   # the native door, where the worker has one
        self._published: int | None = None        # the shard the publisher answers from (a use of it)
        self._publishing = threading.Lock()       # one publish at a time, each of the latest `now`

    @property
    def shard(self) -> ExpertShard | None:
        now = self.now
        return None if now is None else now.built.experts

    def install(self, built: BuiltShard, epoch: int, also: frozenset[int] = frozenset(), owner: str = "",
                assigned: bool = True, switching: bool = False) -> BuiltShard | None:
        """Serve `built` from now on for `epoch` (and `also`); the shard it replaces is returned (closed here
        once no call uses it)."""
        close_now = False
        with self._lock:
            old = self.now
            self.now = Served(built, epoch, also, owner, assigned, switching)
            if old is not None and old.built is not built:
                if self._users.get(id(old.built), 0):
                    self._retired[id(old.built)] = old.built
                else:
                    close_now = True
        self._publish()
        if old is None or old.built is built:
            return None
        if close_now:
            self._close(old.built)
        return old.built

    def set_epochs(self, epoch: int, also: frozenset[int], owner: str, switching: bool = False) -> None:
        """The same experts answer for other epochs (a plan that changes nothing here)."""
        with self._lock:
            if self.now is not None:
                self.now = Served(self.now.built, epoch, also, owner, switching=switching)
        self._publish()

    def _publish(self) -> None:
        """Tell the publisher the shard served now (the latest, whichever change publishes last); the shard it
        answered from before is released, and closed if it was replaced and no call uses it."""
        if self.publisher is None:
            return
        with self._publishing:
            with self._lock:
                now = self.now
                key = None if now is None else id(now.built)
                if key is not None:
                    self._users[key] = self._users.get(key, 0) + 1
            try:
                self.publisher.publish(now)      # returns once nothing computes on the shard before
            except BaseException:
                if key is not None:              # not published: the use taken for it goes
                    self._release(key)
                raise
            key, self._published = self._published, key
        if key is not None:
            self._release(key)

    def use(self, epoch: int, holds: int = 0) -> _Use:
        """The shard a call computes on (`with holding.use(...) as shard`), if it serves the call's epoch and
        (`holds` != 0) holds exactly the experts the router planned here; WrongEpoch otherwise. The shard it gives
        is not closed before the `with` ends, even if a new plan replaces it meanwhile."""
        with self._lock:
            now = self.now
            if now is None:
                raise LookupError("expert worker is still loading its weights; retry")
            if not now.assigned:
                raise WrongEpoch("this worker holds no experts yet: a router assigns them (it was started without "
                                 "--shard)")
            if not now.serves(epoch):
                raise WrongEpoch(f"this call was planned under placement epoch {epoch}, but this worker holds the "
                                 f"experts of epoch {now.epoch}; the router re-plans")
            if holds and holds != now.digest:
                raise WrongEpoch(f"this worker holds other experts than the router planned here under placement "
                                 f"epoch {epoch} (started with other --shard/--replicas?); the router re-syncs it")
            key = id(now.built)
            self._users[key] = self._users.get(key, 0) + 1
        return _Use(self, key, now.built)

    def _release(self, key: int) -> None:
        """A call's use of the shard `key` ended: the last user of a replaced shard closes it."""
        with self._lock:
            self._users[key] -= 1
            done = self._retired.pop(key, None) if not self._users[key] else None
            if not self._users[key]:
                del self._users[key]
        if done is not None:
            self._close(done)

    @staticmethod
    def _close(built: BuiltShard) -> None:
        built.close()
        return_free_heap()                  # the dropped experts' packed memory back to the OS
        log.info("released the experts of the previous plan")


class _Use:
    """One call's hold on a served shard (`Holding.use`): a plain object, not a generator's context manager: a
    decode step's every worker call makes one, on caches its last call's weights have just streamed through."""

    __slots__ = ("holding", "key", "built")

    def __init__(self, holding: Holding, key: int, built: BuiltShard) -> None:
        self.holding, self.key, self.built = holding, key, built

    def __enter__(self) -> ExpertShard:
        return self.built.experts

    def __exit__(self, *exc: object) -> None:
        self.holding._release(self.key)
