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
    n = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                n += f.read().strip() == "colibri-pool"
        except FileNotFoundError:       # a thread that just left
            pass
    return n


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
