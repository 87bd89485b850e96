"""`colibri expert`: the worker process. It serves one shard of the routed experts over gRPC (server.py's
ExpertWorker), listening while the experts load and answering SERVING once they have; a mapped file that changes
under it ends the process with exit 75 (restart me)."""

from __future__ import annotations

import logging
import os

import torch

from colibri_common.checkpoint import Checkpoint, checkpoint_id
from colibri_common.config import ModelConfig
from colibri_common.cpus import format_cpu_list, parse_cpu_list, pin_process
from colibri_common.device import HostStaging, open_device
from colibri_common.errors import ConfigError
from colibri_common.file_watch import EXIT_RESTART
from colibri_common.fleet_token import ENV as FLEET_ENV
from colibri_common.fleet_token import fleet_token
from colibri_common.handlers import add_servicer
from colibri_common.pb import expert_pb2
from colibri_common.serving import Service, host_port, setup_logging
from colibri_common.tls import TlsFiles
from colibri_common.token_gate import TokenGate
from expert_service.build import BuiltShard, build_shard
from expert_service.door import ExpertDoor
from expert_service.local_socket import LocalServer
from expert_service.options import ExpertOptions
from expert_service.server import LOOPBACK, SERVICE, ExpertWorkerServicer, forward_bytes
from kernels import native

log = logging.getLogger("colibri.expert")


def yield_to_router() -> None:
    """A worker serving a router on its own host takes the CPU as a batch job (SCHED_BATCH, this thread and every
    thread it starts): a request it is woken for no longer preempts the router that sent it, which goes on to send
    the layer's other requests and block. On the bench fleet (2 cores, 1 stream) a send took 100-180 µs a layer
    before, 67-74 after. The share of CPU time is unchanged (the same nice)."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as exc:      # not Linux, or refused: the default policy serves as well
        log.info("could not take SCHED_BATCH (%s); the default scheduling policy serves", exc)


def serve_expert(opts: ExpertOptions) -> int:
    """Serve until a signal (exit code 0) or until the experts' bytes cannot be trusted (75: restart me)."""
    setup_logging(f"expert[{opts.shard or opts.port}]", opts.log_level)
    cpus = parse_cpu_list(opts.cpus) if opts.cpus else ()
    if cpus:                                    # before the threads start: each inherits its starter's CPUs
        pin_process(cpus)
    if opts.threads > 0 or cpus:                # --cpus alone: a thread for each of its CPUs, not each of the machine's
        torch.set_num_threads(opts.threads or len(cpus))
    if cpus:
        log.info("running on CPU %s (--cpus), %d torch thread(s)", format_cpu_list(cpus), torch.get_num_threads())
    native.exit_on_sigbus(EXIT_RESTART)         # a mapped file changed during a read: named, exit 75, not -7
    if opts.local_socket:
        yield_to_router()
    device = open_device(opts.device)
    cfg = ModelConfig.from_dir(opts.model)
    token = fleet_token()
    tls = TlsFiles.of(opts.tls_cert, opts.tls_key, opts.tls_ca)
    if tls is not None and tls.ca is None:
        raise ConfigError("a worker with TLS needs --tls-ca too: it accepts only callers whose certificate that "
                          "CA signed (mutual TLS)")
    if token is None and tls is None:
        (log.info if opts.host in LOOPBACK else log.warning)(
            "the worker plane is open: no fleet token ($%s) and no --tls-*, so any client that reaches %s may "
            "call Forward", FLEET_ENV, host_port(opts.host, opts.port))
    # Streams are capped (beyond the cap RESOURCE_EXHAUSTED), and the pool has threads beyond the cap, so
    # idle or slow streams can never leave a health check, Describe or unary Forward without a thread. A
    # message is at most what a router's step sends; a caller without the fleet's token is refused unread.
    limit = forward_bytes(cfg, opts.max_step_tokens)
    service = Service(SERVICE, max_workers=opts.max_streams + 4, max_receive_bytes=limit,
                      interceptors=(TokenGate(token, guarded=() if token is None else None,
                                              serves=(SERVICE, "an expert worker; clients call the router")),))
    servicer = ExpertWorkerServicer(opts.max_streams_per_peer)
    servicer.max_step_tokens = opts.max_step_tokens
    add_servicer(service.server, servicer, expert_pb2.DESCRIPTOR.services_by_name["ExpertWorker"],
                 {"ForwardStream": opts.max_streams, "Forward": opts.max_streams})
    # Listen (liveness answers) while the weights load; readiness turns SERVING only after.
    bound = service.start(opts.host, opts.port, [SERVICE], None if tls is None else tls.server(True))
    built = build_shard(opts, device)
    servicer.checkpoint = Checkpoint(opts.model).fingerprint()
    servicer.checkpoint_id = checkpoint_id(servicer.checkpoint)
    servicer.staging = HostStaging(device)
    servicer.static_shard = bool(opts.shard)
    servicer.assignments.max_experts = opts.max_experts
    servicer.assignments.build = lambda held: build_shard(opts, device, held, tune=False)
    damaged: list[str] = []

    door = ExpertDoor(servicer.checkpoint_id, servicer.instance) \
        if opts.local_socket and device.type == "cpu" and native.available() else None

    def stop_serving(reason: str) -> None:        # once: NOT_SERVING, drain, stop; a restart maps afresh
        if damaged:
            return
        damaged.append(reason)
        if door is not None:
            door.stop()                           # the Python path refuses every call from now on
        service.set_serving(False, reason)
        service.stop_soon(f"{reason}; the experts' bytes are not read any more (a restart maps the files afresh)")

    def serving(b: BuiltShard) -> None:         # the metrics and the file watch follow the experts served
        experts = b.experts
        servicer.metrics.resident_bytes = experts.packed_bytes
        servicer.metrics.in_place_bytes = experts.shard_bytes if experts.in_place else 0
        servicer.metrics.cache, servicer.metrics.mapped_bytes = experts.cache, experts.shard_bytes
        servicer.metrics.mapped_files = sorted(p.resolve() for p in experts.watch.stamps) if experts.watch else []
        if experts.watch is not None:
            experts.watch.watch(stop_serving)

    def installed(b: BuiltShard) -> None:      # a plan's new experts: their pages mapped while they serve
        serving(b)
        b.experts.populate_soon()

    servicer.on_damage = stop_serving
    servicer.assignments.on_install = installed
    serving(built)
    local = None
    if opts.local_socket:                       # same-host routers: Forward without HTTP/2 (gRPC stays for the rest)
        # before the shard is installed: Describe answers from then on, and a router that asked earlier than the
        # socket was named took gRPC for the worker's life
        local = LocalServer(opts.local_socket, servicer.answer_frame, limit, opts.max_streams,
                            None if door is None else door.door)
        servicer.local_socket = str(local.path)
        servicer.metrics.local_open = lambda: local.open_connections
        log.info("Forward also on the local socket %s%s", local.path,
                 " (plain calls answered in native code)" if door is not None else "")
    if door is not None:
        servicer.holding.publisher = door
        servicer.metrics.door = door.stats
    servicer.holding.install(built, 0, assigned=bool(opts.shard))     # without --shard: nothing until assigned
    if opts.metrics_port is not None:
        mport = servicer.metrics.serve(opts.host, opts.metrics_port)
        log.info("metrics on http://%s:%d/metrics", opts.host, mport)
    service.ready(opts.host, bound)
    built.experts.populate_soon()               # after ready: it does not hold the start up
    service.run_until_signal()
    if door is not None:
        door.stop()                               # nothing computes in native code as the process ends
    if local is not None:
        local.close()
    if servicer.holding.now is not None:
        servicer.holding.now.built.keep_heat()
    if damaged:
        log.error("stopped: %s", damaged[0])
        return EXIT_RESTART
    return 0
