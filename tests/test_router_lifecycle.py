"""A router process whose engine thread died (a bug outside a step) stops, with exit code 1, so serve, Kubernetes
or systemd start it again: before, its readiness went NOT_SERVING while its liveness stayed SERVING and the
process lived on, serving nothing, for good (with one replica, an outage no probe would end)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from colibri.client import Client, GenerationError
from tests.conftest import free_port
from tests.test_elastic import ENV, stop, wait_serving, worker

ROUTER_WITH_A_BUG = """
import sys
from router_service.engine import scheduler
calls, schedule = [0], scheduler.Scheduler.schedule
def schedule_with_a_bug(self):
    calls[0] += 1
    if calls[0] == 30:
        raise RuntimeError("an injected scheduler bug")
    return schedule(self)
scheduler.Scheduler.schedule = schedule_with_a_bug
from colibri.cli import entry
sys.argv[0] = "colibri"
sys.exit(entry())
"""


def test_a_router_whose_engine_died_exits_to_be_restarted(oracles):
    path = oracles["qwen3_moe"].path
    with worker(path, "--shard", "0/1") as (w, _):
        port = free_port()
        router = subprocess.Popen([sys.executable, "-c", ROUTER_WITH_A_BUG, "router", "--model", str(path),
                                   "--workers", w, "--port", str(port), "--threads", "1", "--log-level", "WARNING"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  env=dict(ENV, OMP_WAIT_POLICY="PASSIVE"), cwd=Path(__file__).resolve().parents[1])
        try:
            wait_serving(f"127.0.0.1:{port}", "colibri.v1.Generation", router)
            t0 = time.monotonic()
            try:
                with Client(f"127.0.0.1:{port}", timeout=30) as client:
                    client.generate([1, 2, 3], 60, ignore_eos=True)
            except GenerationError as exc:
                assert exc.code().name in ("INTERNAL", "UNAVAILABLE"), exc
            assert router.wait(timeout=30) == 1
            assert time.monotonic() - t0 < 30
            err = router.stderr.read()
            assert "injected scheduler bug" in err and "started again" in err, err[-2000:]
        finally:
            stop(router)
