"""The native ops' thread pool (kernels/native/pool.h): the ops' bits whoever runs their chunks (any thread count,
several Python threads calling at once, a forked child), and as many workers as torch's thread count asks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kernels import native
from kernels.activation import SILU
from tests.kernels.levels import needs_native

pytestmark = needs_native


def _workload(seed: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """A bf16 linear of 7 rows and a layer's experts for 5 tokens: the call giving both outputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(7, 320, generator=g).to(torch.bfloat16)                      # [T, K]
    w = (torch.randn(1000, 320, generator=g) / 18).to(torch.bfloat16)           # [Dout, K]
    E, I, H, T, K = 6, 96, 160, 5, 2
    xs = torch.randn(T, H, generator=g)                                           # [T, H]
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5                          # [E, 2I, H]
    w2 = torch.randn(E, H, I, generator=g) / I**0.5                               # [E, H, I]
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])     # [T, K]
    weights = torch.rand(T, K, generator=g)                                       # [T, K]

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        acc = torch.zeros(T, H, dtype=torch.float64)
        return native.linear(x, w), native.moe_(acc, xs, ids, weights, None, w13, w2, SILU)

    return run


def _same(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def _pool_threads() -> int:
    """Live threads of this process named by the pool."""
    return len(_pool_states())


def test_several_python_threads_calling_at_once_get_the_serial_bits():
    """gRPC handler threads and the engine may call ops together: a caller that finds the pool busy runs its
    chunks itself, and every result is the one a lone call gives."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = [_workload(seed) for seed in range(4)]
        want = [run() for run in runs]
        bad: list[int] = []

        def hammer(i: int) -> None:
            for _ in range(30):
                if not _same(runs[i](), want[i]):
                    bad.append(i)

        ts = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in ts), "a caller hung"
        assert not bad, f"threads {sorted(set(bad))} got other bits than a lone call"
    finally:
        torch.set_num_threads(threads)


def _check_thread_counts() -> None:
    """The pool's workers follow torch.set_num_threads (one thread runs inline and leaves the pool as it was)."""
    run = _workload(1)
    want = run()
    for n in (3, 1, 2, 4, 2):
        torch.set_num_threads(n)
        assert _same(run(), want), f"other bits at {n} threads"
        if n == 1:
            continue                                   # one thread runs inline: the pool is left as it was
        deadline = time.monotonic() + 10
        while (seen := _pool_threads()) != n - 1 and time.monotonic() < deadline:   # the old team's workers leave
            time.sleep(0.01)
        assert seen == n - 1, f"{seen} pool threads at torch.set_num_threads({n})"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_the_pool_has_torchs_thread_count_less_the_caller():
    """Counted in a process of its own: in a test process shared with other tests, a thread an earlier test left
    running (an engine, a server) may call an op at its own thread count meanwhile, and the pool follows that caller
    (a CI run once counted 4 and then 3 workers at 4 threads, one call apart)."""
    root = Path(__file__).resolve().parents[2]
    code = "from tests.kernels.test_native_pool import _check_thread_counts; _check_thread_counts()"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)})
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_a_pool_of_its_own():
    """`colibri serve` forks its services from a parent that has run ops: the child has none of the parent's
    pool threads, so it must start its own rather than wait on them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run = _workload(2)
        want = run()                                       # the parent's pool exists now
        pid = os.fork()
        if pid == 0:                                       # the child: exit 0 only with the parent's bits
            signal.alarm(60)                               # a hang ends the child (SIGALRM), not the suite
            code = 0 if all(_same(run(), want) for _ in range(5)) else 3
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status:#x}"
    finally:
        torch.set_num_threads(threads)


def _pool_states() -> list[str]:
    """The scheduler state (R running, S sleeping, ...) of each of this process's pool threads."""
    states = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if f.read().strip() != "colibri-pool":
                    continue
            with open(f"/proc/self/task/{task}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):   # a thread that left between the listing and the read
            pass
    return states


def _until(want: str, seconds: float) -> list[str]:
    """The one pool thread's state once it is `want` (["R"] or ["S"]), or the states as they are after `seconds`
    (a thread just started may not have its name yet)."""
    deadline = time.monotonic() + seconds
    while (states := _pool_states()) != [want] and time.monotonic() < deadline:
        time.sleep(0.002)
    return states


def _check_rest_and_wake() -> None:
    """With spinning long (COLIBRI_SPIN_US=1 s, its most, set by the caller): after an op the worker spins (R);
    rest() puts it to sleep (S) well before its spin would end, and it stays asleep; wake() gets it spinning again
    with no op, and the next op's bits are the same."""
    torch.set_num_threads(2)
    run = _workload(3)
    want = run()
    assert _until("R", 0.5) == ["R"], "the worker does not spin after an op"
    native.rest()
    assert _until("S", 0.5) == ["S"], "rest() left the worker spinning"
    time.sleep(0.2)
    assert _pool_states() == ["S"], "the worker got up with no op and no wake()"
    native.wake()
    assert _until("R", 0.5) == ["R"], "wake() left the worker asleep"
    assert _same(run(), want), "other bits after wake()"
    native.rest()
    assert _until("S", 0.5) == ["S"], "rest() after wake() left the worker spinning"


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread states through /proc")
def test_rest_puts_the_pool_to_sleep_and_wake_gets_it_up_without_an_op():
    """The router rests the pool as it sends a layer to its workers (the cores go to them) and wakes it as the first
    reply comes in, so its next op finds the worker on a core: a worker woken only by the op took 0.1-0.2 ms to
    run, and the op ran on the caller's thread alone meanwhile. In a process of its own (its spin time is read
    once)."""
    root = Path(__file__).resolve().parents[2]
    code = "from tests.kernels.test_native_pool import _check_rest_and_wake; _check_rest_and_wake()"
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLIBRI_SPIN_US": "1000000", "PYTHONPATH": os.pathsep.join(
                              p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)})
    assert done.returncode == 0, done.stderr[-3000:]
