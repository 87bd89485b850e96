"""The ExpertWorker gRPC service: Describe, Assign, and Forward (unary, streamed, or a frame of the same-host
socket) over the shard it holds; `main.py` runs it as the `colibri expert` process."""

from __future__ import annotations

import collections
import logging
import math
import secrets
import time
from collections.abc import Callable

import grpc
import torch
from google.protobuf.message import DecodeError

from colibri_common import wire
from colibri_common.config import ModelConfig
from colibri_common.device import HostStaging, device_scope
from colibri_common.file_watch import MappingChanged
from colibri_common.pb import expert_pb2, expert_pb2_grpc
from colibri_common.tensors import expert_tensors
from expert_service.assignments import Assignments, Refused
from expert_service.fast_answer import fast_answer
from expert_service.holding import Holding, WrongEpoch
from expert_service.metrics import WorkerMetrics
from expert_service.shard import ExpertShard
from kernels import batch_invariant

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
