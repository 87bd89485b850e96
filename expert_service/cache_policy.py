"""Which hot expert to evict: LRU, or LFU with aging. Plain Python, no torch.

A policy tracks the keys resident in one pool of slots (a key is `(layer, expert)`); the cache asks it
for a victim when a miss needs a slot. Both policies run on a logical clock that ticks once per access,
so they behave the same on a fast machine and a slow one.

LFU with aging: each key's score is its accesses, each weighted 2^(-age / half_life) with age counted
in accesses of the pool since then, so an expert that was hot long ago fades and a newly hot one wins
its slot back after about `half_life` accesses. Scores decay lazily (stored with the tick of their last
update), so an access costs O(1) and a victim O(resident keys).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable

POLICIES = ("lru", "lfu")


class Policy:
    """The resident keys of one pool. `pinned` keys (needed by the call in progress) are never victims."""

    def access(self, key: Hashable) -> None:
        """A hit on a resident key, or a key just admitted."""
        raise NotImplementedError

    def admit(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def victim(self, pinned: Iterable[Hashable] = ()) -> Hashable:
        """The resident key to evict next; KeyError when every resident key is pinned."""
        raise NotImplementedError

    def ranked(self) -> list[Hashable]:
        """The resident keys, hottest first (the last is the next victim)."""
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, key: Hashable) -> bool:
        raise NotImplementedError


class LRU(Policy):
    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()     # least recent first

    def access(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def admit(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._order[key]

    def victim(self, pinned: Iterable[Hashable] = ()) -> Hashable:
        skip = set(pinned)
        for key in self._order:
            if key not in skip:
                return key
        raise KeyError("every resident expert is in use by the call in progress")

    def ranked(self) -> list[Hashable]:
        return list(reversed(self._order))

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order


class LFU(Policy):
    """`half_life`: accesses of this pool after which an access counts half. Ties go to the least recent."""

    def __init__(self, half_life: float = 256.0) -> None:
        if not half_life > 0:
            raise ValueError(f"the LFU half-life must be a positive number of accesses, got {half_life}")
        self.half_life = half_life
        self.tick = 0
        self._score: dict[Hashable, tuple[float, int]] = {}        # key -> (score at tick, tick)

    def _now(self, key: Hashable) -> float:
        score, at = self._score[key]
        return score * 2.0 ** (-(self.tick - at) / self.half_life)

    def score(self, key: Hashable) -> float:
        """The key's aged access count now."""
        return self._now(key)

    def access(self, key: Hashable) -> None:
        self.tick += 1
        self._score[key] = (self._now(key) + 1.0, self.tick)

    def admit(self, key: Hashable) -> None:
        self.tick += 1
        self._score[key] = (1.0, self.tick)

    def remove(self, key: Hashable) -> None:
        del self._score[key]

    def victim(self, pinned: Iterable[Hashable] = ()) -> Hashable:
        skip = set(pinned)
        best: tuple[float, int] | None = None
        out: Hashable | None = None
        for key, (_, at) in self._score.items():
            if key in skip:
                continue
            rank = (self._now(key), at)
            if best is None or rank < best:
                best, out = rank, key
        if best is None:
            raise KeyError("every resident expert is in use by the call in progress")
        return out

    def ranked(self) -> list[Hashable]:
        return sorted(self._score, key=lambda k: (self._now(k), self._score[k][1]), reverse=True)

    def __len__(self) -> int:
        return len(self._score)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._score


def make_policy(name: str, half_life: float = 256.0) -> Policy:
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU(half_life)
    raise ValueError(f"expert cache policy '{name}' is unknown; use one of {', '.join(POLICIES)}")
