"""Child processes forked from a parent that has imported the services' modules once (torch, gRPC, ours).

A child is up in milliseconds instead of the 3-4 s each interpreter spends importing torch, and the
imported pages are shared copy-on-write. `colibri serve` forks its children this way on CPUs; with GPUs
it execs each (a CUDA context cannot cross a fork). The parent must have run no torch operation (an
OpenMP pool does not survive a fork), opened no gRPC channel or server and touched no GPU: importing is
all it does. The child is the command `colibri ARGV...`: its title in `ps` (setproctitle), its
environment in `os.environ`, its stdin / stdout / stderr (and no other descriptor of the parent's), its
signal handlers and its exit code. What differs from an exec: `/proc/PID/environ` is blank (the title
takes that area), and what a library reads from the environment when it loads (OMP_*, MKL_*) is the
parent's: the services set their thread counts themselves.
"""

from __future__ import annotations

import ctypes
import importlib
import io
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping

from colibri_common.heap import importing

PR_SET_PDEATHSIG = 1
# What a service child runs, imported once in the parent. Triton stays out: TRITON_INTERPRET is read when
# a kernel is defined, so each child imports it under its own environment.
SERVICE_MODULES = ("router_service.api.main", "expert_service.main")
FRONT_MODULES = ("colibri.openai_api.server",)
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD)


def preload(modules: tuple[str, ...] = SERVICE_MODULES) -> None:
    """Import what the children will run (the collector off meanwhile, the result frozen: heap.importing).
    libgomp reads OMP_WAIT_POLICY once, when torch loads it: a child waiting on its peers must not spin on the
    shared cores (measured: router step 109 -> 80 ms on 2 cores)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with importing():
        for name in modules:
            importlib.import_module(name)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """The kernel sends `sig` to this process when its parent exits: no orphans."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except OSError:
        pass


class Signalled:
    """Popen's signalling for a child handle that knows its `pid` and can `poll` it (ForkedChild here, the
    suite's fork server's children in tests/forkserver.py)."""

    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:                     # never a signal to a reaped pid (it may be reused)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:              # it has just exited, unreaped: as Popen, not an error
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedChild(Signalled):
    """The part of `subprocess.Popen` the launcher and the tests use, for a child forked by `fork_command`."""

    def __init__(self, pid: int, args: list[str], stdout: io.TextIOWrapper | None) -> None:
        self.pid, self.args, self.stdout = pid, args, stdout
        self.stdin = self.stderr = None
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def _reap(self, flags: int) -> bool:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:                   # reaped elsewhere: the status is lost
            self.returncode = 255 if self.returncode is None else self.returncode
            return True
        if pid == 0:
            return False
        self.returncode = os.waitstatus_to_exitcode(status)   # -N when killed by signal N, as Popen
        return True

    def poll(self) -> int | None:
        if self.returncode is None and self._lock.acquire(blocking=False):
            try:
                if self.returncode is None:
                    self._reap(os.WNOHANG)
            finally:
                self._lock.release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import subprocess

        if timeout is None:
            with self._lock:
                if self.returncode is None:
                    self._reap(0)
            assert self.returncode is not None
            return self.returncode
        end, delay = time.monotonic() + timeout, 0.0005
        while self.poll() is None:
            left = end - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            delay = min(2 * delay, left, 0.05)
            time.sleep(delay)
        return self.returncode  # type: ignore[return-value]


def exit_code(exc: SystemExit) -> int:
    """The status the interpreter would exit with for `exc` (printing a message code, as it does)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


Entry = Callable[[list[str]], int]     # `colibri ARGV...` in this process (colibri.cli.main, handed in by its caller)


def become(argv: list[str], env: Mapping[str, str], fds: tuple[int, int, int], entry: Entry,
           close: tuple[io.IOBase, ...] = ()) -> None:
    """In a freshly forked child: become `colibri ARGV...` (`entry(argv)`) on stdin / stdout / stderr = `fds`
    (closed once duplicated), with the parent's files `close` closed, then exit with its code. Never returns
    (the parent's stack below this frame is not unwound)."""
    rc = 1
    try:
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)    # KeyboardInterrupt, as at start-up
        signal.set_wakeup_fd(-1)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
        for target, fd in enumerate(fds):
            if fd != target:
                os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        for f in close:                              # e.g. the other children's stdout pipes
            f.close()
        # New stream objects with locks of their own (another thread of the parent may have held the old ones)
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True,
                                      errors="backslashreplace")
        sys.argv = ["colibri", *argv]
        _set_title(" ".join(sys.argv))             # first: it needs the environment block as the kernel laid it
        os.environ.clear()
        os.environ.update(env)
        rc = entry(argv)
    except SystemExit as exc:                       # argparse's usage errors, --help
        rc = exit_code(exc)
    except KeyboardInterrupt:
        rc = 128 + signal.SIGINT
    except BaseException:                           # noqa: BLE001  (reported as the interpreter would)
        traceback.print_exc()
        rc = 1
    finally:
        import logging

        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(rc if isinstance(rc, int) and 0 <= rc <= 255 else 1)


def _set_title(title: str) -> None:
    """What `ps` and /proc/PID/cmdline show (else the parent's command line)."""
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except ImportError:
        pass


def fork_command(argv: list[str], env: Mapping[str, str], entry: Entry, stdout_pipe: bool = True,
                 new_group: bool = False, die_with_parent_sig: int | None = signal.SIGTERM,
                 close: tuple[io.IOBase, ...] = ()) -> ForkedChild:
    """Fork `colibri ARGV...` run by `entry` (stdin /dev/null, stdout a pipe when asked, stderr shared; the
    parent's files `close` closed in the child); call it from the main thread. Signals are held across the fork, so one
    that arrives before the child has its own handlers is not taken by the parent's."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()                           # else the child would repeat what is still buffered
        except (OSError, ValueError):                # a reader gone: nothing buffered matters any more
            pass
    r = w = -1
    if stdout_pipe:
        r, w = os.pipe()
    devnull = os.open(os.devnull, os.O_RDONLY)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        pid = os.fork()
        if pid == 0:
            if new_group:
                os.setpgid(0, 0)
            if die_with_parent_sig is not None:
                die_with_parent(die_with_parent_sig)
            if r >= 0:
                os.close(r)
            become(argv, env, (devnull, w if w >= 0 else 1, 2), entry, close)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    os.close(devnull)
    stdout = None
    if r >= 0:
        os.close(w)
        stdout = io.TextIOWrapper(io.FileIO(r, "r"))
    return ForkedChild(pid, ["colibri", *argv], stdout)
