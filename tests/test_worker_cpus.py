"""Where a fleet's workers run (colibri_common/cpus.py, colibri/cores.py): `colibri expert --cpus` pins every
thread of the worker, a CPU the process may not use is refused at start in one line, and `serve` gives each
worker a block of CPUs of its own only where its workers split the whole machine."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from colibri.cores import worker_cpus
from colibri_common.cpus import format_cpu_list, parse_cpu_list, pin_process
from colibri_common.errors import ConfigError
from tests.conftest import COLIBRI


@pytest.mark.parametrize("text, cpus, canonical", [
    ("0", (0,), "0"), ("3,1", (1, 3), "1,3"), ("0-3", (0, 1, 2, 3), "0-3"), ("0,2-4,4,7", (0, 2, 3, 4, 7), "0,2-4,7"),
    (" 5 , 6-6 ", (5, 6), "5-6"),
])
def test_cpu_lists_read_and_write_as_taskset_does(text, cpus, canonical):
    assert parse_cpu_list(text) == cpus
    assert format_cpu_list(cpus) == canonical and parse_cpu_list(canonical) == cpus


@pytest.mark.parametrize("text", ["", "x", "1-", "-1", "2-1", "0,,1", "1.5"])
def test_a_bad_cpu_list_says_how_to_write_one(text):
    with pytest.raises(ValueError, match=r"--cpus .*(give CPU numbers and ranges|rising range)"):
        parse_cpu_list(text)


def test_a_fleet_that_splits_the_machine_gives_each_worker_a_block_of_its_own():
    flat = lambda c: (0, c)                              # noqa: E731  one socket, one thread a core
    assert worker_cpus({0, 1}, 2, 2, flat) == [(0,), (1,)]
    assert worker_cpus({4, 5, 6, 7, 12, 13, 14, 15}, 8, 2, flat) == [(4, 5, 6, 7), (12, 13, 14, 15)]   # a cpuset's
    assert worker_cpus(set(range(6)), 6, 3, flat) == [(0, 1), (2, 3), (4, 5)]
    allowed = os.sched_getaffinity(0)                 # this machine's sysfs: every CPU in one block, none twice
    if len(allowed) % 2 == 0:
        blocks = worker_cpus(allowed, len(allowed), 2)
        assert sorted(c for b in blocks for c in b) == sorted(allowed) and all(len(b) == len(allowed) // 2
                                                                               for b in blocks)


def test_blocks_keep_a_core_s_twin_threads_and_a_socket_s_cores_together():
    # 2 sockets x 4 cores x 2 threads, numbered as Linux does: socket 0's cores 0-3, socket 1's 4-7, then the twins
    def topology(cpu: int) -> tuple[int, int]:
        core = cpu % 8
        return core // 4, core % 4
    assert worker_cpus(set(range(16)), 16, 2, topology) == [(0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15)]
    assert worker_cpus(set(range(16)), 16, 4, topology) == [(0, 1, 8, 9), (2, 3, 10, 11), (4, 5, 12, 13),
                                                            (6, 7, 14, 15)]
    assert worker_cpus(set(range(16)), 16, 8, topology) == [(c, c + 8) for c in range(8)]   # a core each


@pytest.mark.parametrize("allowed, cores, workers", [
    ({0, 1}, 2, 1),               # one worker: all of it is its own anyway
    ({0, 1, 2, 3}, 2, 2),         # --threads 2 of 4: a share, not these CPUs (another fleet may have the rest)
    ({0, 1, 2}, 3, 2),            # blocks of 1 leave a CPU out: the threads would not fit their blocks
    ({0}, 1, 2),                  # more workers than CPUs
])
def test_no_worker_is_pinned_where_the_blocks_would_not_be_the_machine(allowed, cores, workers):
    assert worker_cpus(allowed, cores, workers) == [()] * workers


def _pinned_child(cpus: tuple[int, ...]) -> subprocess.CompletedProcess:
    """A fresh process that starts a thread, pins itself to `cpus`, starts another, and prints every thread's CPUs."""
    code = ("import os, threading, time; from colibri_common.cpus import pin_process\n"
            "ev = threading.Event(); t = threading.Thread(target=ev.wait); t.start()\n"
            f"pin_process({cpus!r})\n"
            "t2 = threading.Thread(target=ev.wait); t2.start()\n"
            "print(sorted({tuple(sorted(os.sched_getaffinity(int(x)))) for x in os.listdir('/proc/self/task')}))\n"
            "ev.set()")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_pinning_moves_every_thread_the_running_ones_and_those_started_after():
    cpu = max(os.sched_getaffinity(0))
    out = _pinned_child((cpu,))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str([(cpu,)])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_a_cpu_the_process_may_not_use_is_refused_naming_those_it_may():
    before = os.sched_getaffinity(0)
    outside = max(before) + 1
    with pytest.raises(ConfigError, match=rf"--cpus {min(before)},{outside}: CPU {outside} is not one this process "
                                          rf"may run on \(it may use {format_cpu_list(before)}\)"):
        pin_process((min(before), outside))
    assert os.sched_getaffinity(0) == before        # nothing was changed by the refusal


def test_an_expert_started_on_a_cpu_it_may_not_use_exits_with_one_line(tmp_path):
    outside = max(os.sched_getaffinity(0)) + 1
    out = subprocess.run([COLIBRI, "expert", "--model", str(tmp_path), "--shard", "0/1", "--port", "0",
                          "--cpus", str(outside)], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"CPU {outside} is not one this process may run on" in out.stderr, out.stderr


def test_an_expert_on_a_few_cpus_runs_a_thread_for_each_not_for_each_of_the_machine_s(tmp_path):
    cpu = max(os.sched_getaffinity(0))
    out = subprocess.run([COLIBRI, "expert", "--model", str(tmp_path), "--shard", "0/1", "--port", "0",
                          "--cpus", str(cpu)], capture_output=True, text=True, timeout=120)
    assert f"running on CPU {cpu} (--cpus), 1 torch thread(s)" in out.stderr, out.stderr
