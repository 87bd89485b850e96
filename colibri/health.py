"""`colibri health`: ask a service's grpc.health.v1 status, as Kubernetes' gRPC probes do."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from colibri_common.flags import option
from colibri_common.options import ClientTls, check_target


@dataclass(frozen=True)
class HealthOptions:
    target: str = option("", "service address HOST:PORT", required=True)
    service: str = option("", "'' = liveness (the default); colibri.v1.Generation (a router) or "
                                   "colibri.v1.ExpertWorker (a worker) = readiness")
    timeout: float = option(10.0, "seconds the health call may take (its gRPC deadline) before the check "
                                        "counts as failed")
    tls_ca: str | None = option(None, "PEM CA of a TLS service (TLS when given)", metavar="PATH")
    tls_cert: str | None = option(None, "PEM client certificate, for a service that requires one", metavar="PATH")
    tls_key: str | None = option(None, "PEM key of --tls-cert", metavar="PATH")
    tls_server_name: str | None = option(None, "the name the service's certificate carries, when it differs from "
                                               "the target's host (a pod probing itself on 127.0.0.1)")

    def __post_init__(self) -> None:
        check_target("--target", self.target)
        if not self.timeout > 0:
            raise ValueError(f"--timeout must be positive, got {self.timeout}")


def is_serving(address: str, service: str, timeout: float = 1.0) -> bool:
    """Whether a plaintext service answers SERVING for `service` ('' = liveness) within `timeout` seconds."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout).status
            return status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def run_health(opts: HealthOptions) -> int:
    """Exit code 0 when SERVING, 1 otherwise (NOT_SERVING, unknown service, unreachable)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from colibri_common.serving import grpc_timeout
    from colibri_common.tls import client_channel

    options = [("grpc.ssl_target_name_override", opts.tls_server_name)] if opts.tls_server_name else []
    with client_channel(opts.target, options, opts.tls_ca, opts.tls_cert, opts.tls_key) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=opts.service), timeout=grpc_timeout(opts.timeout))
        except grpc.RpcError as exc:
            why = exc.details()
            if exc.code() == grpc.StatusCode.NOT_FOUND:     # gRPC's health service says no more than the code
                why = (f"no service '{opts.service}' here; --service '' is liveness, colibri.v1.Generation (a "
                       f"router) or colibri.v1.ExpertWorker (an expert worker) readiness")
            elif exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:   # gRPC says "Deadline Exceeded" alone
                why = (f"no answer within --timeout {opts.timeout:g}s (a process that is frozen, overloaded or "
                       f"swapping, or a port that drops packets)")
            elif exc.code() == grpc.StatusCode.UNAVAILABLE:        # TLS spoken one way only: "Socket closed"
                why += ClientTls(opts.tls_ca, opts.tls_cert, opts.tls_key).hint(why)
            print(f"{opts.target}: {exc.code().name}: {why}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{opts.target} {opts.service or '(liveness)'}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1
