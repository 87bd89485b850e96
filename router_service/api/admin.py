"""The router's Admin service (protos/admin.proto): show the expert workers and their placement, change the set
(resize), re-balance from load. Behind the fleet token (colibri_common/token_gate.py); a router whose experts
are in-process has no workers to show and refuses with FAILED_PRECONDITION."""

from __future__ import annotations

import logging
import time

import grpc

from colibri_common.options import is_address
from colibri_common.pb import admin_pb2, admin_pb2_grpc
from router_service.moe.remote import RemoteExperts
from router_service.moe.resize import Outcome, Placement, ResizeFailed

log = logging.getLogger("colibri.router")
SERVICE = "colibri.v1.Admin"
GUARDED = (f"/{SERVICE}/",)


MAX_ADDRESSES = 1024


def worker_states(remote: RemoteExperts) -> list[admin_pb2.WorkerState]:
    """Every worker of the current plan: its state, experts and load; then those planned out while down."""
    table = remote.table
    plan = table.plan
    pairs = remote.window.worker_pairs(plan.workers)
    total = sum(pairs.values())
    live = remote.liveness.live()
    out = []
    for address in plan.workers:
        w = remote.index[address]
        lv = remote.liveness
        banned = time.monotonic() < lv.banned_until[w]
        # down first (a frozen worker is re-synced once it answers again), then a ban (a call failed: a worker just
        # killed, before its health checks tell), then a re-sync under way
        state = ("serving" if live[w] else "down" if not lv.healthy[w] else "refused" if w in remote.kept_out
                 else "syncing" if not (banned or lv.synced[w]) else "banned")
        held = plan.of(address)
        out.append(admin_pb2.WorkerState(
            address=address, state=state, experts=sum(map(len, held.values())),
            layers=[admin_pb2.HeldExperts(layer=layer, experts=es) for layer, es in sorted(held.items())],
            token_rows=remote.worker_rows[w], pairs_window=pairs[address],
            load_share=pairs[address] / total if total else 0.0, restarts=remote.restarts[address]))
    for address in list(remote.lost):           # planned out while down: shown until planned in again or removed
        if address not in plan.workers:
            out.append(admin_pb2.WorkerState(address=address, state="planned-out", restarts=remote.restarts[address]))
    return out


def replication(remote: RemoteExperts) -> int:
    """The fewest workers any routed expert is on in the plan served now (a static fleet's is its workers'
    --replicas, which the router's own --expert-replicas does not tell)."""
    layers = list(remote.cfg.moe_layers)
    holders = remote.table.holders[layers]                                    # [L_moe, E, W]
    return int(holders.sum(dim=2).min()) if holders.numel() else 0


def _change(out: Outcome) -> admin_pb2.ChangeResponse:
    return admin_pb2.ChangeResponse(changed=out.changed, epoch=out.epoch, seconds=out.seconds,
                                    balance_before=out.balance_before, balance_after=out.balance_after,
                                    message=out.message)


class AdminServicer(admin_pb2_grpc.AdminServicer):
    def __init__(self) -> None:
        self.placement: Placement | None = None          # set once the router is loaded

    def _placement(self, context) -> Placement:
        if self.placement is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the router is still loading; retry")
        return self.placement

    def ShowWorkers(self, request, context):
        p = self._placement(context)
        remote = p.remote
        return admin_pb2.ShowWorkersResponse(
            epoch=remote.table.epoch, workers=worker_states(remote),
            balance=remote.window.balance(remote.table.plan.workers), placement_window=remote.window.steps,
            replicas=replication(remote), redundant_experts=p.opts.redundant_experts, rebalances=remote.rebalances,
            last_change="" if p.last is None else p.last.message)

    def SetWorkers(self, request, context):
        p = self._placement(context)
        lists = [tuple(a.strip() for a in names) for names in (request.workers, request.add, request.remove)]
        if sum(map(len, lists)) > MAX_ADDRESSES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_ADDRESSES} worker addresses in one call")
        bad = [a for names in lists for a in names if not is_address(a)]
        if bad:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"workers must be HOST:PORT addresses, got "
                          f"{', '.join(repr(a) for a in bad)}")
        workers, add, remove = lists
        if not (workers or add or remove):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a router serves with at least one worker: give "
                          "HOST:PORT addresses (workers, or add / remove)")
        log.info("admin: %s", f"set workers to {', '.join(workers)}" if workers else
                 "; ".join(f"{what} {', '.join(names)}" for what, names in (("add", add), ("remove", remove)) if names))
        try:
            return _change(p.set_workers(workers, add=add, remove=remove, wanted=context.is_active))
        except ResizeFailed as exc:
            log.warning("admin: %s", exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    def Rebalance(self, request, context):
        p = self._placement(context)
        try:
            return _change(p.rebalance(wanted=context.is_active))
        except ResizeFailed as exc:
            log.warning("admin: %s", exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
