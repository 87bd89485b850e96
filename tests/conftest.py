"""Shared fixtures: random-weight checkpoints built with transformers and real fleets on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest
import torch

from router_service.metrics import parse
from tests import forkserver
from tests.forkserver import Forked
from tests.models import build_model, save_checkpoint, small_config

REPO = Path(__file__).resolve().parent.parent
COLIBRI = str(Path(sys.executable).parent / "colibri")
ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "minimax_m2", "deepseek_v2", "deepseek_v3",
         "gpt_oss")

torch.set_num_threads(1)
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


def pytest_sessionstart(session):
    """The fork server starts importing now, beside collection and the first tests (not on an xdist
    controller, which runs no test)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(session.config.option, "numprocesses", None):
        forkserver.server(wait=False)


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
          env: dict[str, str] | None = None, exec_: bool = False):
    """`colibri serve` on a free port (with `env` added to the environment); yields (address, launcher process);
    stops it with SIGTERM. Forked by the fork server, or, with `exec_`, the console script exec'd."""
    argv = ["serve", "--model", str(model_dir), "--workers", str(workers), "--port", "0", "--log-level", "WARNING",
            *(extra or [])]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    if exec_:
        p = subprocess.Popen([COLIBRI, *argv], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                             env=full_env)
    else:
        p = colibri_popen(argv, stdout=subprocess.PIPE, env=full_env)
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
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Oracle:
    """A transformers model and its saved checkpoint; its outputs are cached for the whole session."""

    def __init__(self, model, path: Path) -> None:
        self.model, self.path = model, path
        self._greedy: dict[tuple[tuple[int, ...], int], list[int]] = {}
        self._logits: dict[tuple[int, ...], torch.Tensor] = {}

    @torch.no_grad()
    def greedy(self, prompt: list[int], n: int) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self._greedy:
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            self._greedy[key] = out[0, len(prompt):].tolist()
        return self._greedy[key]

    @torch.no_grad()
    def greedy_many(self, prompts: list[list[int]], n: int) -> list[list[int]]:
        """`greedy` of each prompt, those of one length in one batched `generate` (no padding: 16 streams of
        120 tokens in 1 s instead of 10; the same tokens as one by one)."""
        todo: dict[int, list[list[int]]] = {}
        for p in prompts:
            if (tuple(p), n) not in self._greedy:
                todo.setdefault(len(p), []).append(list(p))
        for length, group in todo.items():
            out = self.model.generate(torch.tensor(group), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            for p, row in zip(group, out, strict=True):
                self._greedy[(tuple(p), n)] = row[length:].tolist()
        return [self._greedy[(tuple(p), n)] for p in prompts]

    @torch.no_grad()
    def step_logits(self, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits [n, V] at each of the n = len(tokens) steps of generating `tokens` after `prompt`."""
        seq = prompt + tokens[:-1]
        return self.model(torch.tensor([seq])).logits[0, len(prompt) - 1:].float()

    @torch.no_grad()
    def last_logits(self, prompt: list[int]) -> torch.Tensor:
        key = tuple(prompt)
        if key not in self._logits:
            self._logits[key] = self.model(torch.tensor([prompt])).logits[0, -1].float()
        return self._logits[key]


@pytest.fixture(scope="session")
def oracles(tmp_path_factory) -> dict[str, Oracle]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for i, arch in enumerate(ARCHS):
        model = build_model(small_config(arch), seed=i)
        out[arch] = Oracle(model, save_checkpoint(model, root / arch))
    return out
