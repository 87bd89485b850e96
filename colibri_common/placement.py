"""Which expert lives on which worker: contiguous, balanced ranges, the same for every MoE layer.

With R replicas, the experts of base range b live on workers b, b+1, …, b+R-1 (mod N): every expert on R
distinct workers, every worker holding R ranges, the same answer wherever it is computed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping

from colibri_common.errors import ConfigError


class PlacementError(ConfigError, ValueError):
    """Shards or replicas the experts cannot be split into: a flag to fix (one line on the command line)."""


def shard_experts(num_experts: int, shard: int, num_shards: int) -> list[int]:
    """Experts of shard `shard` of `num_shards`: contiguous ranges whose sizes differ by at most one."""
    if num_shards <= 0 or not 0 <= shard < num_shards:
        raise PlacementError(f"shard {shard}/{num_shards}: need 0 <= I < N")
    if num_shards > num_experts:
        raise PlacementError(f"{num_shards} shards for {num_experts} experts: every shard needs at least one; give "
                             f"at most {num_experts} workers")
    base, extra = divmod(num_experts, num_shards)
    start = shard * base + min(shard, extra)
    size = base + (1 if shard < extra else 0)
    return list(range(start, start + size))


def replica_experts(num_experts: int, shard: int, num_shards: int, replicas: int = 1) -> list[int]:
    """Experts held by worker `shard` when every expert lives on `replicas` distinct workers."""
    if not 1 <= replicas <= num_shards:
        raise PlacementError(f"--replicas {replicas}: need 1 <= R <= the number of workers ({num_shards})")
    held: set[int] = set()
    for r in range(replicas):
        held.update(shard_experts(num_experts, (shard - r) % num_shards, num_shards))
    return sorted(held)


def parse_shard(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with a message that says what to fix."""
    try:
        i, n = (int(p) for p in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like I/N (e.g. 0/2), got '{text}'") from None
    if n <= 0 or not 0 <= i < n:
        raise ValueError(f"--shard {text}: need 0 <= I < N")
    return i, n


def held_digest(held: Mapping[int, Iterable[int]]) -> int:
    """A 64-bit digest of a worker's (layer, expert) set, never 0 (layers without experts count as absent), the same
    in the router (its plan for the worker) and the worker (what it holds): a ForwardRequest that sends the whole
    top-k carries it, so a worker holding other experts than the router planned (restarted with other flags on the
    same epoch 0) refuses the call instead of adding experts the router counted elsewhere."""
    h = hashlib.blake2b(digest_size=8)
    for layer in sorted(held):
        experts = sorted(set(held[layer]))
        if experts:
            h.update(struct.pack(f"<2i{len(experts)}i", layer, len(experts), *experts))
    return int.from_bytes(h.digest(), "little") | 1
