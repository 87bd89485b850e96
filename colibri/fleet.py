"""The children of `colibri serve`, started and stopped: forked from serve once it has imported the services
(`colibri.fork`) or exec'd as fresh `colibri` processes, each in its own process group and dying with serve
(PR_SET_PDEATHSIG); forks only from the main thread (`Fleet.on_main`); stopped in order, the router first."""

from __future__ import annotations

import errno
import logging
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

from colibri.fork import Entry, ForkedChild, die_with_parent, fork_command
from colibri.openai_api.options import OpenAIOptions
from colibri.openai_api.policy import API_KEY_ENV
from colibri_common.errors import ConfigError
from colibri_common.file_watch import EXIT_RESTART
from colibri_common.flags import to_argv
from colibri_common.fleet_token import ENV as FLEET_ENV
from colibri_common.serving import bind_error
from expert_service.options import ExpertOptions
from router_service.api.options import RouterOptions

log = logging.getLogger("colibri.serve")
Child = subprocess.Popen | ForkedChild
T = TypeVar("T")


def colibri_command() -> list[str]:
    exe = Path(sys.executable).parent / "colibri"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "colibri.cli"]


def exit_reason(code: int | None) -> str:
    """What a child's exit code says, for the log: a signal's name and its usual cause."""
    if code is None or code >= 0:
        return " (its files changed under it: it maps them afresh)" if code == EXIT_RESTART else ""
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return ""
    why = {"SIGKILL": "killed: the kernel's OOM killer, or someone's kill -9",
           "SIGBUS": "a read through a mapped file whose pages were gone: a checkpoint file truncated or replaced "
                     "while served",
           "SIGSEGV": "a crash (please report it with the log above)"}.get(name, "")
    return f" ({name}{': ' + why if why else ''})"


CHOSEN_FROM = 20000       # the lowest port free_ports picks


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral ports (net.ipv4.ip_local_port_range): those of outgoing connections and of bind(0)."""
    try:
        lo, hi = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_ports(n: int, avoid: frozenset[int] = frozenset()) -> list[int]:
    """n distinct ports free on loopback now (all held open while choosing, so none repeats), none of `avoid` (the
    ports the flags fix, which their processes have not bound yet). Picked at random below the kernel's ephemeral
    range: a child binds its port a moment later, and meanwhile a port of that range can become another socket's
    (every outgoing connection takes one, and a worker then failed to start with "Address already in use"), where
    one below it is taken only by a process that asks for that number. Where that range leaves too few ports below
    it, the kernel's choice (bind to port 0)."""
    lo, _ = ephemeral_range()
    rng = random.SystemRandom()
    socks: list[socket.socket] = []

    def held() -> set[int]:
        return {s.getsockname()[1] for s in socks}

    try:
        for _ in range(100 * n if lo - CHOSEN_FROM >= 1000 else 0):
            if len(socks) == n:
                break
            port = rng.randrange(CHOSEN_FROM, lo)
            if port in avoid or port in held():
                continue
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            socks.append(sock)
        while sum(p not in avoid for p in held()) < n:
            socks.append(socket.socket())
            socks[-1].bind(("127.0.0.1", 0))
        return [p for p in (s.getsockname()[1] for s in socks) if p not in avoid][:n]
    finally:
        for s in socks:
            s.close()


def check_ports_free(wanted: list[tuple[str, str, int]]) -> None:
    """Each (what, host, port) free to listen on now, else a ConfigError naming the flag: checked before any child
    starts (a router's port in use failed after the workers were forked, the front's once the fleet had loaded)."""
    for what, host, port in wanted:
        if (exc := bind_error(host, port)) is None:
            continue
        shown = f"[{host.strip('[]')}]" if ":" in host else host
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"{what} {port}: {shown}:{port} is in use (another process listens there); give "
                              f"another port, or 0 for a free one")
        if isinstance(exc, socket.gaierror):          # the name, not the port (it blamed --port)
            raise ConfigError(f"--host {host}: no address of this machine by that name ({exc.strerror}); give one "
                              f"of its addresses or names, 127.0.0.1 or 0.0.0.0")
        if exc.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"--host {host}: not an address of this machine ({exc.strerror}); give one of its "
                              f"addresses, 127.0.0.1 or 0.0.0.0")
        raise ConfigError(f"{what} {port}: {shown}:{port} cannot be listened on ({exc.strerror or exc})")


def child_argv(command: str, opts: RouterOptions | ExpertOptions | OpenAIOptions) -> list[str]:
    """The one way `serve` hands options to a child: the flags that rebuild `opts` there."""
    return [command, *to_argv(opts)]


class Fleet:
    def __init__(self, forks: bool = False, entry: Entry | None = None) -> None:
        self.children: list[Child] = []
        self.names: dict[int, str] = {}           # pid -> what it runs, for the log
        self.stopping = threading.Event()
        self.forks = forks
        self.entry = entry                  # what a forked child runs: colibri.cli.main, handed in by the CLI
        self.plane_env: dict[str, str] = {}  # the worker plane's secrets: for the router and the workers only
        # queue.Queue, not SimpleQueue: on the main thread a signal handler that outlasts SimpleQueue.get's
        # timeout made it wait for good (CPython 3.11), where Queue's lock gives up at its deadline. No signal
        # handler puts on it (its lock is not reentrant): they set a flag that `serve_calls` polls.
        self._calls: queue.Queue[tuple[Callable[[], object], Future]] = queue.Queue()

    def spawn(self, command: str, opts: RouterOptions | ExpertOptions | OpenAIOptions) -> Child:
        # PASSIVE: a process waiting on another (router on workers, workers on the router) must not keep
        # spinning OpenMP threads on the shared cores (measured: router step 109 -> 80 ms on 2 cores).
        threads = opts.threads if isinstance(opts, (RouterOptions, ExpertOptions)) else 1   # the front: one
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if command in ("router", "expert"):        # each secret to the children that use it, no further
            env.update(self.plane_env)
            env.pop(API_KEY_ENV, None)
        else:
            env.pop(FLEET_ENV, None)
        argv = child_argv(command, opts)
        # Its own process group: a Ctrl-C in the terminal reaches serve alone, which stops the children in
        # order (the router drains first, the workers after it).
        cmd = [*colibri_command(), *argv]

        def start() -> Child:                       # on the main thread, so `stop` never misses a new child
            if self.stopping.is_set():
                raise RuntimeError("the fleet is stopping")
            if self.forks:                          # the other children's pipes are none of its business
                others = tuple(c.stdout for c in self.children if c.stdout is not None and not c.stdout.closed)
                assert self.entry is not None, "a forking fleet needs the CLI's entry point"
                p: Child = fork_command(argv, env, self.entry, new_group=True, close=others)
            else:
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
                                     preexec_fn=die_with_parent, process_group=0)
            self.children.append(p)
            self.names[p.pid] = f"colibri {command} (pid {p.pid})"
            return p

        p = self.on_main(start)
        log.info("%s pid %d: colibri %s", "forked" if self.forks else "started", p.pid, " ".join(argv))
        return p

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the main thread, the one thread a child may be forked from (a fork copies only the
        calling thread, and PR_SET_PDEATHSIG follows the thread that forked): directly when called there,
        else through `serve_calls`, which the main thread runs while it supervises."""
        if threading.current_thread() is threading.main_thread():
            return fn()
        fut: Future = Future()
        self._calls.put((fn, fut))
        return fut.result()

    def wake(self) -> None:
        """Wake `serve_calls` now (it sees its `until` set at once, not at its next poll)."""
        self._calls.put((lambda: None, Future()))

    def serve_calls(self, until: threading.Event, poll_s: float = 0.05) -> None:
        """The main thread's loop while the fleet runs: the other threads' calls, until `until` is set (call
        `wake` after setting it)."""
        while not until.is_set():
            try:
                fn, fut = self._calls.get(timeout=poll_s)
            except queue.Empty:
                continue
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001  (it is the caller's to handle)
                fut.set_exception(exc)
        while not self._calls.empty():              # a caller waiting at the end gets an answer, not a hang
            self._calls.get_nowait()[1].set_exception(RuntimeError("the fleet is stopping"))

    @staticmethod
    def wait_ready(p: Child, what: str) -> str:
        """Read the child's stdout until `ready HOST:PORT`; error if it exits first."""
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith("ready "):
                return line.split()[1]
        code = p.wait()
        raise RuntimeError(f"{what} exited with code {code} before it was ready (its log is above)")

    def signal_all(self, signum: int) -> None:
        """`signum` to every child still running (a second signal to serve: the router's drain stops at once)."""
        for p in list(self.children):
            if p.poll() is None:
                p.send_signal(signum)

    def stop(self, first: tuple[Child, ...] = (), first_timeout: float = 15.0,
             timeout: float = 15.0) -> None:
        """SIGTERM to `first` (the router, which drains) and wait for them; then the others; SIGKILL whatever
        outlives its timeout."""
        self.stopping.set()
        rest = [p for p in self.children if p not in first]
        for group, wait_s in ((list(first), first_timeout), (rest, timeout)):
            for p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in group:
                try:
                    p.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s did not stop within %.0fs: killing it", self.names.get(p.pid, f"pid {p.pid}"),
                                wait_s)
                    p.kill()
                    p.wait()
