"""CPU lists as taskset and cgroups write them ("0,2-5"), and pinning a process's threads to one (`--cpus`).

A same-host fleet's workers compute a layer at the same time, one a core on a small machine. Left to the scheduler,
a request's wake-up often lands on the core the other worker runs on (the core that sent it was busy with the
router), and sits there for the length of that worker's compute while the other core idles: on a 2-core VM, one
worker call in eight waited 0.15-0.85 ms so (perf sched). A worker pinned to a core of its own runs when its request
comes (docs/performance.md).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from colibri_common.errors import ConfigError


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """"0,2-5" -> (0, 2, 3, 4, 5), sorted and each once; ValueError saying what to fix."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if sep else lo)
        except ValueError:
            raise ValueError(f"--cpus {text!r}: give CPU numbers and ranges, as taskset -c takes them (0,2-5)") \
                from None
        if first < 0 or last < first:
            raise ValueError(f"--cpus {text!r}: {part.strip()!r} is not a CPU number or a rising range (0,2-5)")
        cpus.update(range(first, last + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """(0, 2, 3, 4, 5) -> "0,2-5"."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(c)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


def pin_process(cpus: tuple[int, ...]) -> None:
    """Run this process's threads, those running now and every one started later, on `cpus` only; ConfigError
    where some of them are not CPUs this process may run on (its affinity: the machine's, or a container's cpuset)."""
    allowed = os.sched_getaffinity(0)
    outside = [c for c in cpus if c not in allowed]
    if outside:
        raise ConfigError(f"--cpus {format_cpu_list(cpus)}: CPU {format_cpu_list(outside)} is not one this process "
                          f"may run on (it may use {format_cpu_list(allowed)})")
    done: set[int] = set()
    while todo := {int(t) for t in os.listdir("/proc/self/task")} - done:   # again until no thread is new: one
        for tid in sorted(todo):                                          # started meanwhile by a thread not yet
            try:                                                          # moved has its starter's old set (a thread
                os.sched_setaffinity(tid, cpus)                           # started later inherits the new one)
            except ProcessLookupError:                                    # it ended since the listing
                pass
        done |= todo
