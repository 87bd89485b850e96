"""How `colibri serve` (and `colibri tune`, which measures for it) splits a machine's cores between the router and
its expert workers."""

from __future__ import annotations


def split_threads(cores: int, workers: int) -> tuple[int, int]:
    """(router threads, threads per worker). Router and workers take turns within a step, so each may use the
    cores it would share."""
    return max(1, cores), max(1, cores // max(1, workers))


def worker_cpus(allowed: set[int] | frozenset[int], cores: int, workers: int) -> list[tuple[int, ...]]:
    """The CPUs each of `workers` workers runs on (colibri_common/cpus.py, `colibri expert --cpus`): a block of its
    own of `allowed` (this process's CPUs), cores // workers each, where the fleet splits all of them between two or
    more workers (`cores`, its share of the machine, is every allowed CPU, and each worker's block has as many CPUs
    as the worker has threads); else none pinned, () each. A fleet given a share of the machine (--threads) is not
    told which CPUs to take: another on the host may have been given the others."""
    per = cores // max(1, workers)
    if workers < 2 or cores != len(allowed) or per * workers != cores:
        return [()] * workers
    cpus = sorted(allowed)
    return [tuple(cpus[i * per:(i + 1) * per]) for i in range(workers)]
