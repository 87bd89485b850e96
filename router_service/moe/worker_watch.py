"""The router's view of its workers' health, for its own readiness.

One thread checks every worker's readiness (`grpc.health.v1` Check on the ExpertWorker service, all at once)
four times a second on the channel the experts travel on, with a 0.75 s deadline. A worker that fails
two checks in a row (killed: the connection is refused at once; frozen by SIGSTOP or a hung host: the
deadline passes) is down; one good answer brings it back. `on_change(up, why)` runs after every round, so the
router's readiness is NOT_SERVING within about 2 s of a worker's loss and SERVING again once it is back.
(Polling rather than a health Watch stream: a frozen peer never closes
a stream, while a deadline always passes.)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("colibri.router")
WORKER_SERVICE = "colibri.v1.ExpertWorker"


class WorkerWatch:
    PERIOD_S = 0.25
    DEADLINE_S = 0.75
    MISSES = 2

    def __init__(self, channels: list[tuple[str, grpc.Channel]],
                 on_change: Callable[[list[bool], list[str]], None]) -> None:
        self.stubs = [(address, health_pb2_grpc.HealthStub(ch)) for address, ch in channels]
        self.up = [True] * len(channels)
        self.misses = [0] * len(channels)
        self.why = [""] * len(channels)         # the last failed check's reason (NOT_SERVING, refused, TLS, timeout)
        self.on_change = on_change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-watch", daemon=True)
        self._thread.start()

    def _checks(self) -> list[bool]:
        """Every worker asked at once, so one frozen worker does not delay the verdict on the others."""
        futures = []
        for _, stub in self.stubs:
            try:
                futures.append(stub.Check.future(health_pb2.HealthCheckRequest(service=WORKER_SERVICE),
                                                 timeout=self.DEADLINE_S))
            except ValueError:                    # the channel was closed: the router is stopping
                futures.append(None)
        out = []
        for i, f in enumerate(futures):
            try:
                status = f.result().status if f is not None else None
                out.append(status == health_pb2.HealthCheckResponse.SERVING)
                if not out[-1]:
                    self.why[i] = "not SERVING" if status is not None else "the router is stopping"
            except grpc.RpcError as exc:
                out.append(False)
                self.why[i] = f"{exc.code().name}: {exc.details()}"
            except ValueError:                    # the channel closed under the call: the router is stopping
                out.append(False)
                self.why[i] = "the router is stopping"
        return out

    def _run(self) -> None:
        said = -1e9
        while not self._stop.wait(self.PERIOD_S):
            try:
                self._round()
            except Exception as exc:  # noqa: BLE001  (a round that broke: the watch must outlive it)
                now = time.monotonic()
                if now - said > 60:    # said once a minute: a machine out of threads fails every round
                    log.error("a round of worker health checks failed (%r); the checks go on", exc)
                    said = now

    def _round(self) -> None:
        for i, ((address, _), ok) in enumerate(zip(self.stubs, self._checks(), strict=True)):
            self.misses[i] = 0 if ok else self.misses[i] + 1
            if ok and not self.up[i]:
                self.up[i] = True
                log.info("expert worker %s is serving again", address)
            elif not ok and self.up[i] and self.misses[i] >= self.MISSES:
                self.up[i] = False
                log.warning("expert worker %s is down (%d health checks failed; the last: %s)", address,
                            self.misses[i], self.why[i])
        self.on_change(list(self.up), list(self.why))   # every round (bans end without a health change)

    def close(self) -> None:
        self._stop.set()
