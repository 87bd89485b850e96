"""How `colibri serve` (and `colibri tune`, which measures for it) splits a machine's cores between the router and
its expert workers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def split_threads(cores: int, workers: int) -> tuple[int, int]:
    """(router threads, threads per worker). Router and workers take turns within a step, so each may use the
    cores it would share."""
    return max(1, cores), max(1, cores // max(1, workers))


def worker_cpus(allowed: set[int] | frozenset[int], cores: int, workers: int,
                topology: Callable[[int], tuple[int, int]] | None = None) -> list[tuple[int, ...]]:
    """The CPUs each of `workers` workers runs on (colibri_common/cpus.py, `colibri expert --cpus`): a block of its
    own of `allowed` (this process's CPUs), cores // workers each, where the fleet splits all of them between two or
    more workers (`cores`, its share of the machine, is every allowed CPU, and each worker's block has as many CPUs
    as the worker has threads); else none pinned, () each. A fleet given a share of the machine (--threads) is not
    told which CPUs to take: another on the host may have been given the others. The blocks follow the CPUs'
    (socket, core) order (`topology`, from sysfs), not their numbers: Linux numbers every core's first thread
    before the twin threads, and the sockets' cores in turn, so blocks of numbers would split each core's two
    threads, and each worker's, between the sockets."""
    per = cores // max(1, workers)
    if workers < 2 or cores != len(allowed) or per * workers != cores:
        return [()] * workers
    where = topology or cpu_topology
    cpus = sorted(allowed, key=lambda c: (*where(c), c))
    return [tuple(sorted(cpus[i * per:(i + 1) * per])) for i in range(workers)]


def cpu_topology(cpu: int) -> tuple[int, int]:
    """(socket, core) of a CPU, from /sys/devices/system/cpu; (0, cpu) where sysfs does not say."""
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
    try:
        return int((base / "physical_package_id").read_text()), int((base / "core_id").read_text())
    except (OSError, ValueError):
        return 0, cpu
