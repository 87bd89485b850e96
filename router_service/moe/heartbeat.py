"""Whether a worker's process still answers at all while a long call to it runs (a placement's load may take
minutes: --worker-load-timeout).

A worker loading experts answers its health checks on gRPC's own threads all the while (NOT_SERVING while it
starts, SERVING after: either is an answer). One frozen by SIGSTOP, on a hung host, behind a cut network or
killed before the call reached it (a call made with wait_for_ready then waits for a connection that never comes)
answers nothing: the caller polls `quiet_for()` and gives the call up once the silence is long, rather than
holding every other admin change for the load timeout.
"""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router_service.moe.worker_watch import WORKER_SERVICE, WorkerWatch

LOAD_SILENCE_S = 10.0       # a worker to load a placement that answers no health check this long is given up
# no answer at all: the peer's process is not there or does not run (any status, even an error, is an answer)
_SILENT = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class Heartbeat:
    DEADLINE_S = WorkerWatch.DEADLINE_S      # a check's deadline, as the health watch's

    def __init__(self, channel: grpc.Channel) -> None:
        self.stub = health_pb2_grpc.HealthStub(channel)
        self.last = time.monotonic()             # the call began: its silence is counted from here
        self.why = "no answer yet"
        self._check: grpc.Future | None = None
        self._sent = 0.0

    def quiet_for(self) -> float:
        """Seconds since the worker last answered a check (or since this began); called every fraction of a
        second by the waiting caller, which collects the check in flight and sends the next."""
        now = time.monotonic()
        if self._check is not None and self._check.done():
            try:
                self._check.result()
                self.last = self._sent
            except grpc.RpcError as exc:
                if exc.code() in _SILENT:
                    self.why = f"{exc.code().name}: {exc.details()}"
                else:
                    self.last = self._sent
            self._check = None
        if self._check is None:
            self._sent = now
            self._check = self.stub.Check.future(health_pb2.HealthCheckRequest(service=WORKER_SERVICE),
                                                 timeout=self.DEADLINE_S)
        return now - self.last

    def close(self) -> None:
        if self._check is not None:
            self._check.cancel()
