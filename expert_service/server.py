"""`colibri expert`: serve one shard of the routed experts over gRPC (ExpertWorker)."""

from __future__ import annotations

import collections
import logging
import math
import os
import secrets
import time
from collections.abc import Callable

import grpc
import torch
from google.protobuf.message import DecodeError

from colibri_common import wire
from colibri_common.checkpoint import Checkpoint, checkpoint_id
from colibri_common.config import ModelConfig
from colibri_common.device import HostStaging, device_scope, open_device
from colibri_common.errors import ConfigError
from colibri_common.file_watch import EXIT_RESTART, MappingChanged
from colibri_common.fleet_token import ENV as FLEET_ENV
from colibri_common.fleet_token import fleet_token
from colibri_common.handlers import add_servicer
from colibri_common.pb import expert_pb2, expert_pb2_grpc
from colibri_common.serving import Service, setup_logging
from colibri_common.tensors import expert_tensors
from colibri_common.tls import TlsFiles
from colibri_common.token_gate import TokenGate
from expert_service.assignments import Assignments, Refused
from expert_service.build import BuiltShard, build_shard
from expert_service.fast_answer import fast_answer
from expert_service.holding import Holding, WrongEpoch
from expert_service.local_socket import LocalServer
from expert_service.metrics import WorkerMetrics
from expert_service.options import ExpertOptions
from expert_service.shard import ExpertShard
from kernels import batch_invariant, native

log = logging.getLogger("colibri.expert")
SERVICE = "colibri.v1.ExpertWorker"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class NonFinite(Exception):
    """Non-finite outputs for small, finite inputs: the experts' weights are damaged (the message names them)."""


def non_finite_experts(shard: ExpertShard, layer: int, ids: torch.Tensor) -> str | None:
    """Which of this call's experts give non-finite outputs for a small finite probe (a fixed row of N(0, 0.1)
    values, weight 1), and the files that hold them; None when all are finite, so a call's own huge or
    non-finite inputs are the caller's business (the router fails that request alone) and never stop the
    worker. The slow path, taken only after a non-finite sum."""
    probe = (torch.randn(1, shard.cfg.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.1).to(
        shard.device, shard.dtype)                                                          # [1, H]
    one = torch.ones(1, 1, device=shard.device)                                             # [1, 1]
    bad = [e for e in ids.unique().tolist() if e >= 0 and int(shard.expert_maps[layer][e]) >= 0 and not bool(
        torch.isfinite(shard.forward(layer, probe, torch.tensor([[e]], device=shard.device), one)).all())]
    if not bad:
        return None
    files = sorted({str(shard.ckpt.entry(name).file) for e in bad
                    for name, _ in expert_tensors(shard.cfg, layer, e).values() if name in shard.ckpt})
    return (f"layer {layer} expert{'s' if len(bad) != 1 else ''} {', '.join(map(str, bad))} give non-finite "
            f"outputs for finite inputs: their weights are damaged ({', '.join(files) or 'a packed copy'}); this "
            f"worker stops serving")


def forward_bytes(cfg: ModelConfig, tokens: int) -> int:
    """The largest ForwardRequest a router sends for `tokens` token rows: hidden rows (float64 at most on the
    wire), each row's expert ids (int64) and weights (float64), the prefetch list, and room for framing."""
    return tokens * (cfg.hidden_size * 8 + cfg.top_k * 16) + cfg.num_experts * 8 + (1 << 16)


def peer_host(peer: str) -> str:
    """The caller's host in gRPC's peer string: 'ipv4:10.0.0.7:5123' -> '10.0.0.7', 'ipv6:[::1]:5123' -> '::1'."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return peer


class ExpertWorkerServicer(expert_pb2_grpc.ExpertWorkerServicer):
    def __init__(self, max_per_peer: int = 8) -> None:
        self.peers: collections.Counter[str] = collections.Counter()   # open streams per caller host
        self.max_per_peer = max_per_peer
        self.holding = Holding()                # the experts served now and their placement epochs
        self.staging: HostStaging | None = None
        self.metrics = WorkerMetrics()
        self.local_socket = ""                  # the same-host socket's path, once it listens
        self.max_step_tokens = 0                # what one Forward may carry, told to routers in Describe
        self.static_shard = False               # started with --shard
        self.assignments = Assignments(self.holding)   # a router's plans (Assign)
        self.on_damage: Callable[[str], None] | None = None   # its experts' bytes cannot be trusted: stop serving
        self.instance = secrets.token_hex(8)    # this process: one worker under two addresses is one worker
        self.checkpoint = ""                    # its --model's Checkpoint.fingerprint(), told in Describe
        self.checkpoint_id = 0                  # its 64 bits, against each Forward's

    @property
    def shard(self) -> ExpertShard | None:
        return self.holding.shard

    def _loaded(self, context) -> ExpertShard:
        if self.shard is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "expert worker is still loading its weights; retry")
        return self.shard

    def Describe(self, request, context):
        s = self._loaded(context)
        now = self.holding.now
        cfg = s.cfg
        return expert_pb2.DescribeResponse(
            model_type=cfg.architecture, shard_index=s.shard, num_shards=s.num_shards,
            moe_layers=list(cfg.moe_layers), experts=s.experts, num_experts=cfg.num_experts,
            hidden_size=cfg.hidden_size, intermediate_size=cfg.moe_intermediate_size,
            dtype=s.weight_dtype, packed_bytes=s.packed_bytes,
            expert_cache_slots=0 if s.cache is None else s.cache.hot.w13.shape[0], batch_invariant=batch_invariant(),
            max_step_tokens=self.max_step_tokens, local_socket=self.local_socket,
            epoch=now.epoch if now is not None else 0, max_experts=self.assignments.max_experts,
            static_shard=self.static_shard,
            also_serves=sorted(now.also) if now is not None else [], instance=self.instance,
            owner=now.owner if now is not None else "", assigned=now is not None and now.assigned,
            switching=now is not None and now.switching,
            checkpoint=self.checkpoint,
            layers=[expert_pb2.LayerExperts(layer=layer, experts=es) for layer, es in s.held.items()])

    def Assign(self, request, context):
        self._loaded(context)
        try:
            return self.assignments.assign(request)
        except Refused as exc:
            context.abort(exc.code, str(exc))

    def _compute(self, request: expert_pb2.ForwardRequest) -> expert_pb2.ForwardResponse:
        if request.checkpoint and self.checkpoint_id and request.checkpoint != self.checkpoint_id:
            raise WrongEpoch("this worker serves another checkpoint than the router's --model (restarted on "
                             "another one?); the router re-syncs it, and refuses it")
        with self.holding.use(request.epoch, request.holds) as shard:
            return self._compute_on(shard, request)

    def _compute_on(self, shard: ExpertShard, request: expert_pb2.ForwardRequest) -> expert_pb2.ForwardResponse:
        hidden = wire.decode(request.hidden)                                 # [n, H]
        ids = wire.decode(request.topk_ids)                                  # [n, K]
        weights = wire.decode(request.topk_weights)                          # [n, K]
        H, E = shard.cfg.hidden_size, shard.cfg.num_experts
        if hidden.dim() != 2 or hidden.shape[1] != H or not hidden.is_floating_point():
            raise ValueError(f"hidden must be a float [n, {H}] tensor, got {request.hidden.dtype} "
                             f"{list(hidden.shape)}")
        if ids.is_floating_point() or not weights.is_floating_point():
            raise ValueError(f"topk_ids must be integers and topk_weights floats, got {request.topk_ids.dtype} "
                             f"and {request.topk_weights.dtype}")
        if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != hidden.shape[0]:
            raise ValueError(f"topk_ids {list(ids.shape)} and topk_weights {list(weights.shape)} must be "
                             f"[n={hidden.shape[0]}, K]")
        lo, hi = (int(v) for v in torch.aminmax(ids)) if ids.numel() else (0, 0)      # one op for both ends
        if hi >= E or lo < -1:
            raise ValueError(f"expert ids must be in [-1, {E}) (-1 = none; the model has {E} experts), got "
                             f"{lo}..{hi}")
        if request.layer not in shard.cfg.moe_layers:
            raise ValueError(f"layer {request.layer} has no routed experts; MoE layers are "
                             f"{list(shard.cfg.moe_layers)}")
        if request.explicit and not shard.holds_all(request.layer, ids):
            raise WrongEpoch(f"this worker was sent pairs of experts it does not hold in layer {request.layer} "
                             f"under placement epoch {request.epoch} (restarted with fewer experts?); the router "
                             f"re-syncs it")
        t0 = time.perf_counter()
        with torch.inference_mode(), device_scope(self.staging.device):     # this handler thread's GPU
            hidden_d, ids_d, weights_d = self.staging.to_device(hidden, ids, weights)
            sums = shard.forward(request.layer, hidden_d, ids_d, weights_d)                            # [n, H] f64
            out, = self.staging.to_host(sums if request.exact_sum else sums.to(hidden.dtype))
            # on the host copy (no extra GPU sync per layer); a finite sum means every element is, and a sum that
            # overflows from finite elements is settled by the exact check
            if not math.isfinite(float(out.sum())) and not bool(torch.isfinite(out).all()):
                damaged = non_finite_experts(shard, request.layer, ids_d)         # the inputs' doing, or weights?
                if damaged is not None:
                    raise NonFinite(damaged)
            if request.HasField("prefetch"):                  # packed on the cache's own thread, after this
                shard.hint(request.prefetch.layer, list(request.prefetch.experts))
        seconds = time.perf_counter() - t0
        self.metrics.count("ok", hidden.shape[0], seconds)
        return expert_pb2.ForwardResponse(output=wire.encode(out), compute_ms=seconds * 1e3, instance=self.instance)

    def _refusal(self, exc: Exception) -> str:
        """The status message of a worker that stopped trusting its experts' bytes (it goes NOT_SERVING)."""
        self.metrics.count("unavailable")
        s = self.shard
        who = "expert worker" if s is None or not s.num_shards else f"expert worker {s.shard}/{s.num_shards}"
        if self.on_damage is not None:
            self.on_damage(str(exc))
        return f"{who}: {exc}"

    def _respond(self, request: expert_pb2.ForwardRequest) -> expert_pb2.ForwardResponse:
        return self._compute(request)

    def answer_frame(self, payload: bytes | bytearray) -> tuple[int, bytes | memoryview]:
        """A Forward over the same-host socket (expert_service/local_socket.py): (status, reply bytes or the
        error's message), the statuses the gRPC path would give."""
        if self.shard is None:
            return grpc.StatusCode.UNAVAILABLE.value[0], b"expert worker is still loading its weights; retry"
        try:
            request = expert_pb2.ForwardRequest.FromString(payload)
        except DecodeError as exc:
            self.metrics.count("invalid_argument")
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], f"not a ForwardRequest: {exc}".encode()
        try:
            if self.staging is not None and self.staging.device.type == "cpu" and (fast := fast_answer(
                    request, payload, self.holding, self.checkpoint_id, self.instance)) is not None:
                reply, rows, seconds = fast                   # one native call: the same bytes as the Python path's
                self.metrics.count("ok", rows, seconds)
                return 0, memoryview(reply.numpy())
            return 0, self._respond(request).SerializeToString()
        except (MappingChanged, NonFinite) as exc:
            return grpc.StatusCode.UNAVAILABLE.value[0], self._refusal(exc).encode()
        except WrongEpoch as exc:                   # up, but not under that plan: the router re-syncs it
            self.metrics.count("failed_precondition")
            return grpc.StatusCode.FAILED_PRECONDITION.value[0], str(exc).encode()
        except LookupError as exc:
            self.metrics.count("unavailable")
            return grpc.StatusCode.UNAVAILABLE.value[0], str(exc).encode()
        except ValueError as exc:
            self.metrics.count("invalid_argument")
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], str(exc).encode()
        except Exception as exc:  # noqa: BLE001 (logged whole here; the router gets a status, not a traceback)
            self.metrics.count("internal")
            log.exception("Forward failed on layer %d (router step %d)", request.layer, request.step)
            return grpc.StatusCode.INTERNAL.value[0], f"expert compute failed on layer {request.layer}: " \
                f"{exc!r}".encode()

    def _answer(self, request, context) -> expert_pb2.ForwardResponse:
        try:
            return self._respond(request)
        except (MappingChanged, NonFinite) as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, self._refusal(exc))
        except WrongEpoch as exc:                   # up, but not under that plan: the router re-syncs it
            self.metrics.count("failed_precondition")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except LookupError as exc:
            self.metrics.count("unavailable")
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except ValueError as exc:
            self.metrics.count("invalid_argument")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception as exc:  # noqa: BLE001 (logged whole here; the router gets a status, not a traceback)
            self.metrics.count("internal")
            log.exception("Forward failed on layer %d (router step %d)", request.layer, request.step)
            context.abort(grpc.StatusCode.INTERNAL, f"expert compute failed on layer {request.layer}: {exc!r}")

    def Forward(self, request, context):
        self._loaded(context)
        peer = self._enter_peer(context)
        try:
            return self._answer(request, context)
        finally:
            with self.metrics.lock:
                self.peers[peer] -= 1

    def ForwardStream(self, request_iterator, context):
        self._loaded(context)
        peer = self._enter_peer(context)
        with self.metrics.lock:
            self.metrics.streams_open += 1
        try:
            for request in request_iterator:
                yield self._answer(request, context)
        finally:
            with self.metrics.lock:
                self.metrics.streams_open -= 1
                self.peers[peer] -= 1

    def _enter_peer(self, context) -> str:
        """Count a stream against its caller's host (`--max-streams-per-peer`): one caller cannot take every
        slot of `--max-streams`."""
        peer = peer_host(context.peer())
        with self.metrics.lock:
            full = self.peers[peer] >= self.max_per_peer
            if not full:
                self.peers[peer] += 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{peer} holds {self.max_per_peer} streams of this "
                          f"worker already (--max-streams-per-peer); close one or retry later")
        return peer


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
    native.exit_on_sigbus(EXIT_RESTART)         # a mapped file changed during a read: named, exit 75, not -7
    if opts.local_socket:
        yield_to_router()
    if opts.threads > 0:
        torch.set_num_threads(opts.threads)
    device = open_device(opts.device)
    cfg = ModelConfig.from_dir(opts.model)
    token = fleet_token()
    tls = TlsFiles.of(opts.tls_cert, opts.tls_key, opts.tls_ca)
    if tls is not None and tls.ca is None:
        raise ConfigError("a worker with TLS needs --tls-ca too: it accepts only callers whose certificate that "
                          "CA signed (mutual TLS)")
    if token is None and tls is None:
        (log.info if opts.host in LOOPBACK else log.warning)(
            "the worker plane is open: no fleet token ($%s) and no --tls-*, so any client that reaches %s:%d may "
            "call Forward", FLEET_ENV, opts.host, opts.port)
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

    def stop_serving(reason: str) -> None:        # once: NOT_SERVING, drain, stop; a restart maps afresh
        if damaged:
            return
        damaged.append(reason)
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

    servicer.on_damage = stop_serving
    servicer.assignments.on_install = serving
    serving(built)
    local = None
    if opts.local_socket:                       # same-host routers: Forward without HTTP/2 (gRPC stays for the rest)
        # before the shard is installed: Describe answers from then on, and a router that asked earlier than the
        # socket was named took gRPC for the worker's life
        local = LocalServer(opts.local_socket, servicer.answer_frame, limit, opts.max_streams)
        servicer.local_socket = str(local.path)
        servicer.metrics.local_open = lambda: local.open_connections
        log.info("Forward also on the local socket %s", local.path)
    servicer.holding.install(built, 0, assigned=bool(opts.shard))     # without --shard: nothing until assigned
    if opts.metrics_port is not None:
        mport = servicer.metrics.serve(opts.host, opts.metrics_port)
        log.info("metrics on http://%s:%d/metrics", opts.host, mport)
    service.ready(opts.host, bound)
    service.run_until_signal()
    if local is not None:
        local.close()
    if servicer.holding.now is not None:
        servicer.holding.now.built.keep_heat()
    if damaged:
        log.error("stopped: %s", damaged[0])
        return EXIT_RESTART
    return 0
