"""The router's worker health watch outlives a round that breaks (a machine out of threads: gRPC's futures raise
RuntimeError) and goes on deciding readiness; it used to die with that round, readiness frozen."""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health_pb2

from router_service.moe.worker_watch import WorkerWatch


class Flaky:
    """A health stub whose Check.future raises `fails` times (as `can't start new thread` did), then answers."""

    def __init__(self, fails: int) -> None:
        self.fails = fails
        self.Check = self

    def future(self, request, timeout):
        if self.fails:
            self.fails -= 1
            raise RuntimeError("can't start new thread")
        return _Done()


class _Done(grpc.Future):
    def result(self, timeout=None):
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    def cancel(self): return False
    def cancelled(self): return False
    def running(self): return False
    def done(self): return True
    def exception(self, timeout=None): return None
    def traceback(self, timeout=None): return None
    def add_done_callback(self, fn): fn(self)


def test_a_round_that_raises_does_not_end_the_watch(caplog):
    rounds = []
    seen = threading.Event()

    def on_change(up: list[bool], why: list[str]) -> None:
        rounds.append(up)
        if up == [True]:                              # a round after the three that raised
            seen.set()

    watch = WorkerWatch([], on_change)
    watch.stubs = [("w:1", Flaky(3))]             # after construction: the thread reads stubs each round
    watch.up, watch.misses = [True], [0]
    try:
        assert seen.wait(10), "the watch stopped after a round that raised"
    finally:
        watch.close()
    assert rounds[-1] == [True]
    assert sum("a round of worker health checks failed" in r.getMessage() for r in caplog.records) == 1
