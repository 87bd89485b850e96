"""`colibri router`: the router process. It serves the Generation service (server.py) and the Admin service
(admin.py) in front of the engine, listening while the model loads and the workers answer; it stops on its own when
the weights it reads in place change (exit 75: restart me) or its engine dies (exit 1), and drains on SIGTERM."""

from __future__ import annotations

import logging
import threading
import time

import torch

from colibri_common.errors import ColibriError
from colibri_common.file_watch import EXIT_RESTART
from colibri_common.fleet_token import fleet_token
from colibri_common.handlers import add_servicer
from colibri_common.pb import admin_pb2
from colibri_common.pb import generation_pb2 as pb
from colibri_common.serving import Service, setup_logging
from colibri_common.tls import TlsFiles
from colibri_common.token_gate import TokenGate
from kernels import native
from router_service.api import admin
from router_service.api.build import BuiltEngine, build_engine, remote_experts
from router_service.api.options import RouterOptions
from router_service.api.server import SERVICE, GenerationServicer
from router_service.moe.follow import wait_for_workers
from router_service.moe.remote import RemoteExperts
from router_service.moe.resize import Placement, PlacementOptions

log = logging.getLogger("colibri.router")


def serve_router(opts: RouterOptions) -> int:
    """Serve until a signal (exit code 0), or until the checkpoint bytes it reads in place change under it
    (EXIT_RESTART: a restart maps the files afresh)."""
    setup_logging("router", opts.log_level)
    native.exit_on_sigbus(EXIT_RESTART)         # a mapped file changed during a read: named, exit 75, not -7
    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    if not opts.workers and not opts.follow_workers:
        raise ColibriError("--workers must list at least one expert worker address HOST:PORT (or give "
                           "--follow-workers NAME:PORT)")

    t0 = time.perf_counter()
    sched = opts.sched
    # Generate calls are capped at what the engine can hold (running + waiting, + a few finishing their
    # last sends); the pool has threads to spare beyond that, so health checks, Abort and ModelInfo always
    # answer.
    cap = sched.max_batch_size + sched.max_waiting + 4
    # the Admin service (workers, placement) takes the fleet token; Generation stays the clients'
    service = Service(SERVICE, max_workers=cap + 8, max_receive_bytes=opts.max_request_bytes,
                      interceptors=(TokenGate(fleet_token(), guarded=admin.GUARDED),))
    servicer = GenerationServicer(opts)
    add_servicer(service.server, servicer, pb.DESCRIPTOR.services_by_name["Generation"], {"Generate": cap})
    admin_servicer = admin.AdminServicer()
    # changes queue behind one another (one runs at a time); a few may wait, beyond them RESOURCE_EXHAUSTED
    add_servicer(service.server, admin_servicer, admin_pb2.DESCRIPTOR.services_by_name["Admin"], {"SetWorkers": 4,
                                                                                            "Rebalance": 2})
    tls = TlsFiles.of(opts.tls_cert, opts.tls_key, opts.tls_ca)
    if opts.tls_client_auth and tls is None:
        raise ColibriError("--tls-client-auth needs --tls-cert, --tls-key and --tls-ca")
    bound = service.start(opts.host, opts.port, [SERVICE, admin.SERVICE],
                          None if tls is None else tls.server(opts.tls_client_auth))
    # the workers the name stands for now (the first pods may be starting)
    workers = opts.workers or wait_for_workers(opts.follow_workers, 600.0)
    built = build_engine(opts, remote_experts(opts, workers))
    damaged: list[tuple[str, int]] = []           # why it stops on its own, and the exit code that says so
    once = threading.Lock()                       # the watch's thread and the engine's may both see the change

    def stop_serving(reason: str, then: str = "the router's weights are not read any more (a restart maps the "
                                              "files afresh)", code: int = EXIT_RESTART) -> None:
        with once:                                # once: NOT_SERVING, drain, stop
            if damaged:
                return
            damaged.append((reason, code))
        service.set_serving(False, reason)
        service.stop_soon(f"{reason}; {then}")

    built.engine.on_damage = stop_serving
    built.engine.on_stopped = lambda why: stop_serving(why, "the router stops so that it is started again (by "
                                                            "serve, Kubernetes or systemd)", 1)
    if built.mapped is not None:
        built.mapped.watch(stop_serving)
    built.engine.start()
    servicer.ready(built)
    assert isinstance(built.experts, RemoteExperts)             # remote_experts built them
    placement = Placement(built.experts, PlacementOptions(
        opts.expert_replicas, opts.redundant_experts, opts.rebalance_interval, opts.worker_load_timeout,
        min(opts.worker_timeout, 10.0), opts.replan_dead_after))
    admin_servicer.placement = placement
    if opts.follow_workers:
        placement.follow(opts.follow_workers, opts.follow_interval)
    if opts.metrics_port is not None:
        mport = built.engine.metrics.serve(opts.host, opts.metrics_port)
        log.info("metrics on http://%s:%d/metrics", opts.host, mport)
    log.info("router loaded in %.2fs", time.perf_counter() - t0)
    # readiness follows the workers: NOT_SERVING while an expert has no live worker (or the engine has stopped)
    def readiness(ok: bool) -> None:
        why = "draining" if built.engine.draining else "the engine stopped" if built.engine.stopped is not None \
            else "" if ok else "some experts have no live worker"
        service.set_serving(not why, why)

    built.experts.watch(readiness)
    service.ready(opts.host, bound)
    built.settle()
    closed = threading.Event()

    def stop() -> None:
        closed.set()
        placement.close()
        built.close()

    service.run_until_signal(drain=lambda: _drain(built, opts.grace_period, closed), on_stop=stop)
    if damaged:
        log.error("stopped: %s", damaged[0][0])
        return damaged[0][1]
    return 0


def _drain(built: BuiltEngine, grace: float, closed: threading.Event) -> None:
    """`closed`: the engine was stopped under the drain (a second signal), which ends the open requests too."""
    n = len(built.engine.seqs)
    log.info("draining: %d open requests get up to %.0fs to finish; new ones are refused", n, grace)
    finished = built.engine.drain(grace)
    if closed.is_set():
        log.warning("the drain was cut short: the requests still open then (%d when it began) ended UNAVAILABLE", n)
    elif finished:
        log.info("drained: every open request finished")
    else:
        log.warning("grace period over: %d requests still open end UNAVAILABLE", len(built.engine.seqs))
