"""`serve` heals: a SIGKILLed router is started again on its port and serves within seconds (the clients'
channels reconnect), and a fleet stopped for a fatal reason (a worker that cannot start again) exits non-zero."""

from __future__ import annotations

import shutil
import signal
import time

import grpc
import psutil
from grpc_health.v1 import health_pb2

from colibri.client import Client
from tests.conftest import argv_of, fleet
from tests.test_robustness import health


def child(proc, role: str) -> psutil.Process:
    return next(c for c in psutil.Process(proc.pid).children() if role in argv_of(c))


def serving(addr: str) -> bool:
    try:
        return health(addr, timeout=1.0) == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def test_a_killed_router_is_back_within_seconds(oracles):
    oracle = oracles["olmoe"]
    with fleet(oracle.path, 2) as (addr, proc):
        client = Client(addr)
        assert client.generate([1, 2, 3], 4).token_ids == oracle.greedy([1, 2, 3], 4)
        old = child(proc, "router")
        t0 = time.monotonic()
        old.send_signal(signal.SIGKILL)
        old.wait(timeout=10)
        while not serving(addr):
            assert time.monotonic() - t0 < 15, "the router was not back and SERVING within 15 s"
            time.sleep(0.05)
        assert child(proc, "router").pid != old.pid
        assert client.generate([1, 2, 3], 4, timeout=30).token_ids == oracle.greedy([1, 2, 3], 4)   # same client
        assert proc.poll() is None


def test_a_fleet_stopped_for_a_fatal_reason_exits_non_zero(oracles, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(oracles["olmoe"].path, model)
    with fleet(model, 2) as (addr, proc):
        for f in model.glob("*.safetensors"):            # a worker started now cannot load its experts
            f.rename(f.with_suffix(".gone"))
        child(proc, "expert").send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
