"""The suite's fork server: `colibri ...` commands forked from one process that has imported torch, gRPC and
the services once, instead of an interpreter each that spends 3-4 s importing them (the suite starts about
a hundred). Each is still a real process: its own pid, stdin / stdout / stderr, environment, working
directory and exit code, signalled with real signals; `colibri serve` forks its own children from there
as it does anywhere (`colibri.fork`).

The server is a child of the test process (`python -m tests.forkserver SOCKET`), single-threaded, that has
never run a torch operation nor opened a gRPC channel: each request on its Unix socket carries argv, env
and cwd with the three descriptors (SCM_RIGHTS); the answer is the pid, then, when that process has
exited, its exit code. Tests that check the console script itself (`--help`, `--version`, exit codes of
the entry point) still exec `colibri`; so do fleets given an environment of their own (TRITON_INTERPRET is
read when a kernel is defined, and /proc/PID/environ shows only what exec was given).
"""

from __future__ import annotations

import atexit
import io
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

from colibri.cli import main
from colibri.fork import FRONT_MODULES, SERVICE_MODULES, Signalled, become, die_with_parent, preload

PIPE, DEVNULL = subprocess.PIPE, subprocess.DEVNULL
_PRELOAD = SERVICE_MODULES + FRONT_MODULES + ("colibri.cli", "colibri.validate", "colibri.client",
                                               "colibri.launcher", "colibri.tune", "colibri.loadgen")


def _send(conn: socket.socket, msg: dict) -> None:
    try:
        conn.sendall(json.dumps(msg).encode() + b"\n")
    except OSError:                                   # the test gave up on it: nothing to tell
        pass


def serve(path: str) -> None:
    """The server's loop: accept a request, fork, answer the pid; report each exit to its requester."""
    die_with_parent(signal.SIGKILL)
    preload(_PRELOAD)
    assert "triton" not in sys.modules, "the fork server must not define Triton kernels for its children"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # a handler, so SIGCHLD reaches the wakeup pipe
    print("ready", flush=True)
    pending: dict[socket.socket, None] = {}           # connections whose request has not come yet
    running: dict[int, socket.socket] = {}            # pid -> its requester
    while True:
        try:
            ready, _, _ = select.select([listener, wake_r, *pending], [], [], 1.0)
        except InterruptedError:
            continue
        for r in ready:
            if r is listener:
                conn, _ = listener.accept()
                pending[conn] = None
            elif r == wake_r:
                os.read(wake_r, 4096)
            else:
                del pending[r]
                _start(r, listener, [*pending, *running.values()], wake_r, wake_w, running)
        while running:                                # reap every exited child, report its code
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = running.pop(pid, None)
            if conn is not None:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()


def _start(conn: socket.socket, listener: socket.socket, others: list[socket.socket], wake_r: int, wake_w: int,
           running: dict[int, socket.socket]) -> None:
    fds: list[int] = []
    try:
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        req = json.loads(data)
        if len(fds) != 3 or not os.path.isdir(req["cwd"]):
            raise ValueError("a request is argv, env and an existing cwd, with three descriptors")
    except (OSError, ValueError, KeyError) as exc:
        for fd in fds:
            os.close(fd)
        _send(conn, {"error": str(exc)})
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        for s in (listener, conn, *others):
            s.close()
        os.close(wake_r)
        os.close(wake_w)
        die_with_parent(signal.SIGTERM)
        os.chdir(req["cwd"])
        become(req["argv"], req["env"], (fds[0], fds[1], fds[2]), main)
    for fd in fds:
        os.close(fd)
    running[pid] = conn
    _send(conn, {"pid": pid})


class Forked(Signalled):
    """A `colibri` process started by the fork server: the parts of `subprocess.Popen` the tests use."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, stdout, stderr) -> None:
        self.args, self.pid, self.stdout, self.stderr, self.stdin = args, pid, stdout, stderr, None
        self.returncode: int | None = None
        self._conn = conn
        self._buf = b""
        self._lock = threading.Lock()

    def _read_exit(self, timeout: float | None) -> None:
        with self._lock:
            if self.returncode is not None:
                return
            chunk = None
            if b"\n" not in self._buf:
                if not select.select([self._conn], [], [], timeout)[0]:
                    return
                chunk = self._conn.recv(4096)
                self._buf += chunk
            if b"\n" in self._buf:
                self.returncode = int(json.loads(self._buf.split(b"\n")[0])["exit"])
                self._conn.close()
            elif not chunk:                               # the server went away
                self.returncode = 255
                self._conn.close()

    def poll(self) -> int | None:
        self._read_exit(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read_exit(left)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple:
        """Read stdout and stderr to their ends (together, so neither pipe fills), then wait."""
        outs = {s: [] for s in (self.stdout, self.stderr) if s is not None}
        end = None if timeout is None else time.monotonic() + timeout
        open_ = list(outs)
        while open_:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            for s in select.select(open_, [], [], left)[0]:
                chunk = os.read(s.fileno(), 1 << 16)
                if chunk:
                    outs[s].append(chunk)
                else:
                    open_.remove(s)
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        got = []
        for s in (self.stdout, self.stderr):
            if s is None:
                got.append(None)
                continue
            raw = b"".join(outs[s])
            got.append(raw.decode(errors="replace") if isinstance(s, io.TextIOBase) else raw)
            s.close()
        return tuple(got)


SHARED = "COLIBRI_TEST_FORKSERVER"       # the socket of the server that pytest-xdist's controller started


def _running(pid: int) -> bool:
    """pid is a live process (not a zombie: the controller that started a shared server reaps it only at exit)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class ForkServer:
    """The server process and its socket; with `shared` (its pid and socket), one that another process started
    (pytest-xdist's workers share their controller's: one import of torch and the services for the run)."""

    def __init__(self, shared: tuple[int, str] | None = None) -> None:
        self.proc: subprocess.Popen | None = None
        self._ready = False
        self._pid = 0
        if shared is not None:
            (self._pid, self.path), self._dir = shared, None
            return
        self._dir = tempfile.mkdtemp(prefix="colibri-forkserver-")
        self.path = os.path.join(self._dir, "socket")
        repo = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]).rstrip(":"))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver", self.path], stdout=PIPE,
                                     stdin=DEVNULL, text=True, cwd=repo, env=env)
        atexit.register(self.close)

    @property
    def shared(self) -> str:
        """What the processes that share this server find in $COLIBRI_TEST_FORKSERVER."""
        assert self.proc is not None
        return f"{self.proc.pid}:{self.path}"

    def alive(self) -> bool:
        return self.proc.poll() is None if self.proc is not None else _running(self._pid)

    def wait_ready(self) -> None:
        """Until the server has imported everything and listens (it starts at once, this waits on first use)."""
        if self._ready:
            return
        if self.proc is None:                         # another process's: ready once its socket listens
            while True:
                try:
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                        probe.connect(self.path)      # the server answers this empty request with an error
                    break
                except (FileNotFoundError, ConnectionRefusedError):
                    if not self.alive():
                        raise RuntimeError(f"the shared fork server (pid {self._pid}) exited") from None
                    time.sleep(0.05)
        else:
            line = self.proc.stdout.readline()        # type: ignore[union-attr]
            if line.strip() != "ready":
                raise RuntimeError(f"the fork server did not start (exit {self.proc.wait()}): {line!r}")
        self._ready = True

    def close(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None, stdout=None, stderr=None,
              text: bool = True, cwd: str | None = None) -> Forked:
        """`subprocess.Popen(["colibri", *argv], ...)` for stdout / stderr None, PIPE, DEVNULL, a descriptor or a
        file object (and stderr STDOUT)."""
        self.wait_ready()
        mine, theirs = [], []
        devnull = os.open(os.devnull, os.O_RDWR)
        fds = [devnull]
        for spec, target in ((stdout, 1), (stderr, 2)):
            if spec == PIPE:
                r, w = os.pipe()
                mine.append(io.TextIOWrapper(io.FileIO(r, "r")) if text else io.FileIO(r, "r"))
                theirs.append(w)
                fds.append(w)
            elif spec == subprocess.STDOUT and target == 2:
                mine.append(None)
                fds.append(fds[1])                       # stderr where stdout goes
            else:
                mine.append(None)
                fds.append(devnull if spec == DEVNULL else target if spec is None else
                           spec if isinstance(spec, int) and spec >= 0 else spec.fileno())
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            req = {"argv": list(argv), "env": dict(os.environ if env is None else env), "cwd": cwd or os.getcwd()}
            socket.send_fds(conn, [json.dumps(req).encode()], fds)
            answer = b""
            while b"\n" not in answer:
                chunk = conn.recv(4096)
                if not chunk:
                    raise RuntimeError("the fork server closed the connection before answering")
                answer += chunk
            first, rest = answer.split(b"\n", 1)
            if "pid" not in json.loads(first):
                raise RuntimeError(f"the fork server refused the request: {first.decode()}")
        finally:
            for fd in (devnull, *theirs):
                os.close(fd)
        child = Forked(["colibri", *argv], int(json.loads(first)["pid"]), conn, mine[0], mine[1])
        child._buf = rest
        return child

    def run(self, argv: Sequence[str], timeout: float, env: Mapping[str, str] | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
        """`subprocess.run(["colibri", *argv], capture_output=True, text=True, timeout=...)`."""
        p = self.popen(argv, env=env, stdout=PIPE, stderr=PIPE, cwd=cwd)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)


_SERVER: ForkServer | None = None
_SERVER_LOCK = threading.Lock()


def server(wait: bool = True) -> ForkServer:
    """The suite's fork server: the one named by $COLIBRI_TEST_FORKSERVER while it runs, else this process's
    own, started if it is not running (a shared one that died is replaced by an own one)."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or not _SERVER.alive():
            pid, _, path = os.environ.get(SHARED, "").partition(":")
            shared = (int(pid), path) if pid.isdigit() and path and _running(int(pid)) else None
            _SERVER = ForkServer(shared if _SERVER is None else None)
        if wait:
            try:
                _SERVER.wait_ready()
            except RuntimeError:
                if _SERVER.proc is not None:
                    raise
                _SERVER = ForkServer()
                _SERVER.wait_ready()
        return _SERVER


if __name__ == "__main__":
    serve(sys.argv[1])
