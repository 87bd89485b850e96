"""What every Colibri gRPC service does alike: message limits, health, reflection, ready line, shutdown."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

MAX_MESSAGE_BYTES = 512 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
STOP_GRACE_S = 5.0      # for open calls to receive their final status after on_stop, then they are cancelled

log = logging.getLogger("colibri")


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s {role} %(levelname)s %(message)s")


class Service:
    """A gRPC server with health (liveness on "", readiness on the service name) and reflection."""

    def __init__(self, service_name: str, max_workers: int) -> None:
        self.name = service_name
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=CHANNEL_OPTIONS)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._stopped = threading.Event()

    def start(self, host: str, port: int, full_names: list[str]) -> int:
        reflection.enable_server_reflection([*full_names, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self.server)
        bound = self.server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise OSError(f"cannot listen on {host}:{port} (address in use?)")
        self.server.start()
        return bound

    def ready(self, host: str, port: int) -> None:
        self.health.set(self.name, health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on %s:%d", self.name, host, port)
        print(f"ready {host}:{port}", flush=True)

    def run_until_signal(self, on_stop=None) -> None:
        """Block until SIGINT/SIGTERM; then mark NOT_SERVING, run `on_stop` (the router fails its open requests
        with UNAVAILABLE there: there is no drain yet), give open calls STOP_GRACE_S to send their status, stop."""
        def handler(signum, _frame):
            log.info("received %s: not serving any more; open requests end UNAVAILABLE, stopping within %.0fs",
                     signal.Signals(signum).name, STOP_GRACE_S)
            self._stopped.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
        self._stopped.wait()
        self.health.enter_graceful_shutdown()
        if on_stop is not None:
            on_stop()
        self.server.stop(STOP_GRACE_S).wait()
        log.info("stopped")
