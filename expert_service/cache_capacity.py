"""`--expert-cache-capacity`: how many of a worker's experts stay packed (hot). Plain Python, no torch.

Forms: `all` (the default: every expert hot, nothing evicted), `N` (experts in total, one pool shared by
the MoE layers), `N/layer` (N slots per MoE layer, each layer evicting only its own), `P%` (of the
worker's experts) or bytes with a unit (`2GiB`, `512MiB`, `1.5GB`: as many experts as fit).

A share or a byte budget is split evenly over the MoE layers (rounded down), as per-layer pools: every
step visits every layer once, so one pool shared by all of them is the scan that LRU handles worst (a
layer's experts are evicted just before the next step needs them; measured on the skewed bench at 25%:
0.2% hits shared, against per-layer pools in `benchmarks/results/expert_cache.md`). A budget smaller than
one expert per layer stays one shared pool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from colibri_common.errors import ConfigError

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SPEC = re.compile(r"^\s*(?:(?P<all>all)|(?P<n>\d+)\s*(?P<per>/\s*layer)?|(?P<pct>\d+(?:\.\d+)?)\s*%"
                   r"|(?P<size>\d+(?:\.\d+)?)\s*(?P<unit>(?:[kmgt]i?)?b))\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class CacheCapacity:
    """Slots of the hot tier: `slots` in total, or per MoE layer when `per_layer`. None slots = all hot."""

    slots: int | None
    per_layer: bool = False

    def __post_init__(self) -> None:
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"an expert cache needs at least 1 slot, got {self.slots}")

    @property
    def bounded(self) -> bool:
        return self.slots is not None

    def total_slots(self, num_layers: int) -> int | None:
        if self.slots is None:
            return None
        return self.slots * num_layers if self.per_layer else self.slots


def check_capacity(spec: str) -> None:
    """Raise ValueError with what to write instead, before anything is loaded."""
    if _SPEC.match(spec) is None:
        raise ValueError(f"--expert-cache-capacity '{spec}' is not understood; write all, a number of experts "
                         f"(16), per layer (4/layer), a share of this worker's experts (25%) or bytes (2GiB)")
    m = _SPEC.match(spec)
    if m and m["pct"] is not None and not 0 < float(m["pct"]) <= 100:
        raise ValueError(f"--expert-cache-capacity {spec}: a share must be in (0, 100]%")
    if m and m["n"] is not None and int(m["n"]) < 1:
        raise ValueError(f"--expert-cache-capacity {spec}: at least 1 expert")
    if m and m["size"] is not None and not float(m["size"]) > 0:
        raise ValueError(f"--expert-cache-capacity {spec}: a byte budget must be positive")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def parse_capacity(spec: str, experts_per_layer: int, num_layers: int, expert_bytes: int,
                   flag: str = "--expert-cache-capacity") -> CacheCapacity:
    """The slots `spec` means for a worker holding `experts_per_layer` experts in each of `num_layers` MoE
    layers, `expert_bytes` each (packed). Capacities that hold everything are `all` (no cache at all)."""
    check_capacity(spec)
    m = _SPEC.match(spec)
    assert m is not None
    total = experts_per_layer * num_layers
    if m["all"]:
        return CacheCapacity(None)
    if m["n"] is not None:
        n = int(m["n"])
        if n < 1:
            raise ValueError(f"--expert-cache-capacity {spec}: at least 1 expert")
        if m["per"]:
            return CacheCapacity(None) if n >= experts_per_layer else CacheCapacity(n, per_layer=True)
        return CacheCapacity(None) if n >= total else CacheCapacity(n)
    if m["pct"] is not None:
        n = max(1, round(total * float(m["pct"]) / 100))
    else:
        size = float(m["size"]) * _UNITS[m["unit"].lower()]
        n = int(size // expert_bytes)
        if n < 1:
            raise ConfigError(f"{flag} {spec} holds no expert: one takes {_size(expert_bytes)} "
                              f"packed; give at least that, a count (e.g. 1/layer) or a share (e.g. 10%)")
    if n >= total:
        return CacheCapacity(None)
    return CacheCapacity(n // num_layers, per_layer=True) if n >= num_layers else CacheCapacity(n)
