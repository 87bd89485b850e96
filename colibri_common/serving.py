"""What every Colibri gRPC service does alike: message limits, health, reflection, ready line, shutdown."""

from __future__ import annotations

import errno
import logging
import os
import select
import signal
import socket
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from colibri_common.errors import ColibriError
from colibri_common.options import GRPC_MAX_BYTES

MAX_MESSAGE_BYTES = 512 * 2**20      # between router and workers (a step's hidden states); clients get less
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# A server that is still starting or was just restarted is found again within a second, not after gRPC's default
# backoff (which grows to two minutes: an HTTP front stayed 503 for 13 s after its router was back). A rescheduled
# pod behind a headless Service comes back with a new IP: the DNS name is resolved again on reconnect, at most once
# a second (gRPC's default waits 30 s between resolutions). The router's links to its workers, and every Client.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000), ("grpc.dns_min_time_between_resolutions_ms", 1000)]


GRPC_MAX_TIMEOUT_S = 1e9   # gRPC's deadline overflows from ~1e10 s (DEADLINE_EXCEEDED at once): 31 years is "none"


def grpc_timeout(seconds: float) -> float:
    """A call's timeout as gRPC can take it: one past GRPC_MAX_TIMEOUT_S (or inf) is that (a user's 1e10 or inf
    failed every call at once)."""
    return min(seconds, GRPC_MAX_TIMEOUT_S)


def channel_options(*lists: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """Option lists merged, a later value of a key replacing an earlier one (gRPC keeps the first of a repeated
    key: appended overrides were silently ignored)."""
    merged: dict[str, object] = {}
    for options in lists:
        merged.update(options)
    return list(merged.items())


# Clients (the router watching its workers) may ping every second to find a frozen peer.
SERVER_KEEPALIVE = [("grpc.http2.min_ping_interval_without_data_ms", 1000), ("grpc.keepalive_permit_without_calls", 1),
                    ("grpc.http2.max_ping_strikes", 0)]
# gRPC binds with SO_REUSEPORT by default: a second service on a port in use started, said ready, and the kernel shared
# the connections between the two (a router's health check answered by an expert worker). Off: a busy port is an error.
NO_PORT_SHARING = [("grpc.so_reuseport", 0)]
STOP_GRACE_S = 5.0      # for open calls to receive their final status after on_stop, then they are cancelled
WAKE_POLL_S = 1.0       # the main thread's longest sleep between looks at the stop flags (a wake byte ends it sooner)

log = logging.getLogger("colibri")


def bind_error(host: str, port: int) -> OSError | None:
    """Why HOST:PORT cannot be listened on now, as the OS says it, or None where it can (bound as the services bind:
    SO_REUSEADDR, so a closed connection's TIME_WAIT is no owner)."""
    try:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        with socket.socket(family) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host.strip("[]"), port))
    except OSError as exc:
        return exc
    return None


def why_not_bound(host: str, port: int) -> str:
    """Why an address cannot be listened on, as the OS says it (gRPC does not)."""
    if not 0 <= port <= 65535:
        return "the port must be 0-65535"
    exc = bind_error(host, port)
    if exc is None:
        return "gRPC could not bind it"
    hint = " (another service listens there; --port 0 picks a free port)" if exc.errno == errno.EADDRINUSE else ""
    return f"{exc.strerror or exc}{hint}"


def setup_logging(role: str, level: str = "INFO") -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr, force=True,
                        format=f"%(asctime)s {role} %(levelname)s %(message)s")


def host_port(host: str, port: int) -> str:
    """HOST:PORT as gRPC and the ready line take it: an IPv6 address in brackets ([::]:50051; ':::50051' is no
    address to gRPC)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class Service:
    """A gRPC server with health (liveness on "", readiness on the service name) and reflection."""

    def __init__(self, service_name: str, max_workers: int, max_receive_bytes: int = MAX_MESSAGE_BYTES,
                 interceptors: tuple[grpc.ServerInterceptor, ...] = ()) -> None:
        self.name = service_name
        receive = min(max_receive_bytes, GRPC_MAX_BYTES)    # a worker's limit for a huge --max-step-tokens
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", receive), *SERVER_KEEPALIVE, *NO_PORT_SHARING]
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options,
                                  interceptors=interceptors)
        self._loaded = False
        self._healthy = True       # what the service's own checks say (the router: every expert has a worker)
        self._lock = threading.Lock()
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(service_name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._stopped = threading.Event()
        self._wake = os.pipe()     # (read, write): a byte wakes run_until_signal's main thread (a signal, stop_soon)
        for fd in self._wake:
            os.set_blocking(fd, False)
        self._signalled = False    # SIGTERM/SIGINT received (set by the handler: a plain attribute, no lock)
        self._hurry = False        # a second one: stop without the drain's grace
        self._previous_wake: int | None = None    # the wakeup fd before ours, once the signals are caught

    def start(self, host: str, port: int, full_names: list[str],
              credentials: grpc.ServerCredentials | None = None) -> int:
        reflection.enable_server_reflection([*full_names, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self.server)
        try:
            bound = self.server.add_insecure_port(host_port(host, port)) if credentials is None else \
                self.server.add_secure_port(host_port(host, port), credentials)
        except RuntimeError:         # grpcio raises where it once returned 0, and says no more than that
            bound = 0
        if bound == 0:
            raise ColibriError(f"cannot listen on {host}:{port}: {why_not_bound(host, port)}")
        self.server.start()
        return bound

    def _publish(self) -> None:
        with self._lock:
            serving = self._loaded and self._healthy and not self._stopped.is_set()
            self.health.set(self.name, health_pb2.HealthCheckResponse.SERVING if serving
                            else health_pb2.HealthCheckResponse.NOT_SERVING)

    def set_serving(self, healthy: bool, why: str = "") -> None:
        """Readiness from the service's own checks (it is SERVING only when loaded, healthy and not stopping);
        `why` it is not. A WARNING when it goes NOT_SERVING while it serves; INFO when it stops (a drain)."""
        if healthy != self._healthy:
            stopping = self._stopped.is_set()
            log.log(logging.INFO if healthy or stopping else logging.WARNING, "readiness: %s%s",
                    "SERVING" if healthy else "NOT_SERVING", f" ({why})" if why and not healthy else "")
        self._healthy = healthy
        self._publish()

    def stop_soon(self, why: str) -> None:
        """Stop as a signal would (readiness NOT_SERVING, the drain, stop), for a reason of the service's own."""
        log.error("%s: not serving any more, stopping", why)
        self._stopped.set()
        try:
            os.write(self._wake[1], b"\0")
        except OSError:              # the pipe full: the main thread has bytes to wake it already
            pass

    def ready(self, host: str, port: int) -> None:
        self._catch_signals()      # before anyone can know it serves: a SIGTERM from then on drains, never kills
        self._loaded = True
        self._publish()
        log.info("serving %s on %s", self.name, host_port(host, port))
        print(f"ready {host_port(host, port)}", flush=True)

    def run_until_signal(self, drain=None, on_stop=None) -> None:
        """Block until SIGINT/SIGTERM (or stop_soon); then readiness NOT_SERVING, `drain()` (the router lets its open
        requests finish, refusing new ones), `on_stop()` (what is still open ends UNAVAILABLE), STOP_GRACE_S for the
        calls to send their status, stop. A second signal during the drain stops at once.

        The main thread sleeps in `select` on a pipe that the signal's C-level handler writes to
        (`signal.set_wakeup_fd`), never in an untimed wait: the kernel hands a process's SIGTERM to any thread that
        does not block it (a gRPC thread, often), where the C handler only flags it, and Python runs the Python
        handler on the main thread once that thread runs bytecode again. An untimed `Event.wait` slept through such
        a signal for good (a worker ignored SIGTERM about once in a thousand stops). The Python handler only sets
        plain attributes: it runs between two bytecodes of the main thread, which may hold any lock then."""
        self._catch_signals()
        while not (self._signalled or self._stopped.is_set()):
            select.select([self._wake[0]], [], [], WAKE_POLL_S)
            self._drain_wake()
        self._stopped.set()
        self._publish()                           # NOT_SERVING for the service; liveness ("") stays SERVING
        if drain is not None:
            t = threading.Thread(target=drain, name="drain", daemon=True)
            t.start()
            while t.is_alive() and not self._hurry:
                t.join(timeout=0.2)
        self.health.enter_graceful_shutdown()
        if on_stop is not None:
            on_stop()
        self.server.stop(0 if self._hurry else STOP_GRACE_S).wait()
        if self._previous_wake is not None:
            signal.set_wakeup_fd(self._previous_wake)
        log.info("stopped")

    def _catch_signals(self) -> None:
        """SIGTERM and SIGINT handled by `_on_signal` from here on (once; on the main thread, the only one Python
        lets set them). `ready` calls it: a worker signalled between its ready line and `run_until_signal` had died
        by the default action, its socket and its drain left undone (a loaded 2-core run showed it)."""
        if self._previous_wake is not None or threading.current_thread() is not threading.main_thread():
            return
        self._previous_wake = signal.set_wakeup_fd(self._wake[1], warn_on_full_buffer=False)
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._signalled or self._stopped.is_set():
            log.info("received %s again: stopping now", signal.Signals(signum).name)
            self._hurry = True
            return
        log.info("received %s: not serving any more, stopping", signal.Signals(signum).name)
        self._signalled = True

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake[0], 512):
                pass
        except BlockingIOError:
            pass
