"""A router's plans for this worker (the `Assign` RPC): which experts to hold from now on, under which placement
epoch and whose plan it is. The request is checked (layers, ids, the --max-experts budget, epochs, the owner);
the new experts are built beside the old ones (mapped in place or packed) and swapped in whole (holding.py), so
calls in flight finish on what they started with. One plan at a time."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from colibri_common.config import ModelConfig
from colibri_common.pb import expert_pb2
from expert_service.build import BuiltShard, describe_held
from expert_service.holding import Holding

log = logging.getLogger("colibri.expert")
MAX_EPOCH = 1 << 62        # placement epochs stay far from uint64's end (a router adds one to the highest it sees)


class Refused(Exception):
    """An Assign this worker does not take: the gRPC status and a message that says why."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def checked_plan(request: expert_pb2.AssignRequest, cfg: ModelConfig, max_experts: int, budget: bool = True
                 ) -> dict[int, list[int]]:
    """The request's experts per MoE layer, checked: known layers, ids in range, no layer twice, within
    `max_experts` a layer (`budget`; a switch holds the old and new experts together for a while)."""
    held: dict[int, list[int]] = {layer: [] for layer in cfg.moe_layers}
    seen: set[int] = set()
    for le in request.layers:
        if le.layer not in held:
            raise ValueError(f"layer {le.layer} has no routed experts; MoE layers are {list(cfg.moe_layers)}")
        if le.layer in seen:
            raise ValueError(f"layer {le.layer} is named twice in the plan")
        seen.add(le.layer)
        es = sorted(set(le.experts))
        if es and not (0 <= es[0] and es[-1] < cfg.num_experts):
            raise ValueError(f"layer {le.layer}: expert ids must be in [0, {cfg.num_experts}), got {es[0]}..{es[-1]}")
        if budget and max_experts and len(es) > max_experts:
            raise ValueError(f"layer {le.layer}: {len(es)} experts assigned, but this worker holds at most "
                             f"{max_experts} a layer (--max-experts)")
        held[le.layer] = es
    return held


class Assignments:
    def __init__(self, holding: Holding) -> None:
        self.holding = holding
        self.max_experts = 0                                 # --max-experts: 0 = no limit
        self.build: Callable[[dict[int, list[int]]], BuiltShard] | None = None   # a plan -> its experts, ready
        self.on_install: Callable[[BuiltShard], None] | None = None           # a new plan's experts are served
        self._lock = threading.Lock()

    def assign(self, request: expert_pb2.AssignRequest) -> expert_pb2.AssignResponse:
        if request.epoch >= MAX_EPOCH or any(e >= MAX_EPOCH for e in request.also_serves):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"placement epochs must be below {MAX_EPOCH}")
        with self._lock:
            now = self.holding.now
            assert now is not None                            # the servicer answers only once a shard is installed
            s = now.built.experts                             # read under the lock: the plan in force now
            if request.epoch < now.epoch:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"placement epoch {request.epoch} is older than "
                              f"this worker's {now.epoch}: another router planned since; describe again")
            if now.owner and request.owner != now.owner and request.epoch <= now.epoch:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"this worker holds placement epoch {now.epoch} "
                              f"of router {now.owner}; another router takes it over only with a higher epoch (one "
                              f"router owns a fleet's placement)")
            try:
                held = checked_plan(request, s.cfg, self.max_experts, budget=not request.switching)
            except ValueError as exc:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
            also = frozenset(request.also_serves) - {request.epoch}
            t0 = time.perf_counter()
            if held == s.held and now.assigned:               # nothing moves here
                self.holding.set_epochs(request.epoch, also, request.owner, request.switching)
            else:
                assert self.build is not None                 # set before the worker serves
                try:
                    built = self.build(held)
                except Exception as exc:  # noqa: BLE001 (the plan fails, the worker keeps serving the old one)
                    log.exception("could not load the experts of placement epoch %d", request.epoch)
                    raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"could not load the experts of epoch "
                                  f"{request.epoch}: {type(exc).__name__}: {exc}") from exc
                self.holding.install(built, request.epoch, also, request.owner, switching=request.switching)
                if self.on_install is not None:
                    self.on_install(built)
            s = self.holding.now.built.experts
            seconds = time.perf_counter() - t0
            log.info("placement epoch %d%s: %s, %.1f MiB packed, loaded in %.3fs", request.epoch,
                     f" (and {', '.join(map(str, sorted(also)))} while the router switches)" if also else "",
                     describe_held(s.held), s.packed_bytes / 2**20, seconds)
            return expert_pb2.AssignResponse(epoch=request.epoch, experts=sum(map(len, s.held.values())),
                                             packed_bytes=s.packed_bytes, load_ms=seconds * 1e3)
