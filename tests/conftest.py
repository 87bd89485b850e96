"""Shared fixtures: random-weight checkpoints built with transformers and real fleets on loopback."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from colibri_common.heap import skip_exit_collection
from router_service.engine.metrics import parse
from tests import forkserver
from tests.forkserver import Forked

if TYPE_CHECKING:
    from tests.models import Oracle

REPO = Path(__file__).resolve().parent.parent
COLIBRI = str(Path(sys.executable).parent / "colibri")
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "minimax_m2", "deepseek_v2", "deepseek_v3",
         "gpt_oss")

# The measured CPU forms (and expert heat files) of every service the suite starts go to a directory of
# this run's own, not ~/.cache: one for the whole run, shared by pytest-xdist's workers (the forms file is
# written under a lock), removed when the run ends.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
if "COLIBRI_CACHE_DIR" not in os.environ:
    if _RUN:
        os.environ["COLIBRI_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"colibri-test-cache-{_RUN}")
        os.makedirs(os.environ["COLIBRI_CACHE_DIR"], exist_ok=True)
    else:
        os.environ["COLIBRI_CACHE_DIR"] = tempfile.mkdtemp(prefix="colibri-test-cache-")
    _OWN_CACHE = os.environ["COLIBRI_CACHE_DIR"]
else:
    _OWN_CACHE = None


def _controller(config) -> bool:
    """pytest-xdist's controller, which runs no test: it need not import torch or transformers (5 s before
    the workers could start)."""
    return bool(getattr(config.option, "numprocesses", None)) and not os.environ.get("PYTEST_XDIST_WORKER")


def pytest_configure(config):
    if not _controller(config):
        import torch

        torch.set_num_threads(1)
        atexit.register(skip_exit_collection)   # 2 s of each test process's exit (colibri_common/heap.py)


def pytest_sessionstart(session):
    """The fork server starts importing now, beside collection and the first tests. pytest-xdist's controller
    starts it before its workers (its own hook is trylast), which find it in their environment and share it."""
    srv = forkserver.server(wait=False)
    if _controller(session.config):
        os.environ[forkserver.SHARED] = srv.shared


def pytest_sessionfinish(session, exitstatus):
    """The run's cache directory goes when the run ends (on the controller, after every xdist worker)."""
    import shutil

    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if _OWN_CACHE:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
    uid = getattr(session.config.option, "testrunuid", None)          # the workers' shared one
    if uid:
        shutil.rmtree(os.path.join(tempfile.gettempdir(), f"colibri-test-cache-{uid}"), ignore_errors=True)


def colibri_popen(argv: list[str], stdout=None, stderr=None, env: dict[str, str] | None = None) -> Forked:
    """`colibri ARGV...` as a process of its own, forked by the suite's fork server (tests/forkserver.py)."""
    return forkserver.server().popen(argv, env=env, stdout=stdout, stderr=stderr)


def colibri_run(argv: list[str], timeout: float = 120, env: dict[str, str] | None = None
                ) -> subprocess.CompletedProcess:
    """`colibri ARGV...` to its end, stdout and stderr captured as text (forked by the fork server)."""
    return forkserver.server().run(argv, timeout=timeout, env=env)


def argv_of(proc: psutil.Process) -> list[str]:
    """A service's command line as words (a forked child shows it as one title: `colibri expert --shard ...`)."""
    return " ".join(proc.cmdline()).split()


@contextmanager
def fleet(model_dir: Path | str, workers: int = 2, extra: list[str] | None = None, timeout: float = 120,
          env: dict[str, str] | None = None, exec_: bool = False, stderr=None):
    """`colibri serve` on a free port (with `env` added to the environment, its log to `stderr` where given);
    yields (address, launcher process); stops it with SIGTERM. Forked by the fork server, or, with `exec_`, the
    console script exec'd (`python -m colibri.cli` where none is installed)."""
    argv = ["serve", "--model", str(model_dir), "--workers", str(workers), "--port", "0", "--log-level", "WARNING",
            *(extra or [])]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    if exec_:
        from colibri.fleet import colibri_command  # the console script, or `python -m colibri.cli`

        p = subprocess.Popen([*colibri_command(), *argv], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                             env=full_env, stderr=stderr)
    else:
        p = colibri_popen(argv, stdout=subprocess.PIPE, stderr=stderr, env=full_env)
    try:
        p.openai = None                  # type: ignore[attr-defined]  (the HTTP front's base URL, when started)
        line = p.stdout.readline()
        if line.startswith("openai "):   # --openai-port: its line comes just before the fleet's ready line
            p.openai = line.split()[1]   # type: ignore[attr-defined]
            line = p.stdout.readline()
        if not line.startswith("ready "):
            p.wait(timeout=30)
            raise RuntimeError(f"colibri serve did not become ready (exit {p.returncode}): {line!r}")
        yield line.split()[1], p
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)          # a test that failed while it held serve (SIGSTOP)
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                for c in psutil.Process(p.pid).children(recursive=True):
                    c.kill()
                p.kill()


def metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse(r.read().decode())


def free_port() -> int:
    """A port free on loopback now, below the ephemeral range (serve's choice: colibri/fleet.py `free_ports`)."""
    from colibri.fleet import free_ports

    return free_ports(1)[0]


def metrics_port(workers: int) -> int:
    """A port P for `serve --metrics-port P` whose run P .. P + workers is free on loopback now: serve gives its
    workers P + 1 .. P + workers, which a free P alone does not make free (a parallel test's server held P + 1 once)."""
    import socket

    for _ in range(100):
        p = free_port()
        if p + workers > 65535:
            continue
        socks = [socket.socket() for _ in range(workers + 1)]
        try:
            for q, sock in zip(range(p, p + workers + 1), socks, strict=True):
                sock.bind(("127.0.0.1", q))
            return p
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no run of {workers + 1} free ports on loopback")


@pytest.fixture(scope="session")
def oracles(tmp_path_factory) -> dict[str, Oracle]:
    from tests.models import Oracle, build_model, save_checkpoint, small_config

    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for i, arch in enumerate(ARCHS):
        model = build_model(small_config(arch), seed=i)
        out[arch] = Oracle(model, save_checkpoint(model, root / arch))
    return out
