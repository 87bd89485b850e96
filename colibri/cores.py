"""How `colibri serve` (and `colibri tune`, which measures for it) splits a machine's cores between the router and
its expert workers."""

from __future__ import annotations


def split_threads(cores: int, workers: int) -> tuple[int, int]:
    """(router threads, threads per worker). Router and workers take turns within a step, so each may use the
    cores it would share."""
    return max(1, cores), max(1, cores // max(1, workers))
