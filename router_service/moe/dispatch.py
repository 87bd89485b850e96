"""One MoE layer's requests to the expert workers (`RemoteExperts.submit`): the token-expert pairs partitioned by the
placement table (each worker's share of a static plan, or each pair to one live holder of its expert where the plan
is explicit or a worker is down), encoded once, and sent; `InFlight` waits for the replies and combines them.

Shapes: T tokens in the step, H hidden size, K experts per token (top-k), E experts per layer, W workers.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from colibri_common import wire
from colibri_common.config import ModelConfig
from colibri_common.device import HostStaging
from colibri_common.pb import expert_pb2
from kernels import native, native_wire
from router_service.moe.experts import ExpertsUnavailable, Prefetch
from router_service.moe.in_flight import InFlight, Part, Sender
from router_service.moe.load_window import LoadWindow
from router_service.moe.partition import partition, place
from router_service.moe.same_host import Links
from router_service.moe.table import Table
from router_service.moe.transport import Reply

REFUSES = "it refuses this router (another checkpoint, or another router's plan)"


class Dispatching(Sender, Protocol):
    """What a layer's dispatch needs of the experts client (remote.RemoteExperts)."""

    cfg: ModelConfig
    table: Table
    wire_dtype: torch.dtype
    staging: HostStaging
    links: Links
    window: LoadWindow
    routed: torch.Tensor | None
    step: int
    checkpoint_id: int
    kept_out: set[int]
    sync_wait_s: float
    worker_rows: list[int]
    timers: dict[str, float]

    @property
    def switch_pending(self) -> bool: ...


def submit(ex: Dispatching, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
           prefetch: Prefetch | None = None) -> InFlight:
    """hidden [T, H], ids [T, K], weights [T, K] float32 -> a handle for Σ_k w_k · FFN_{e_k}(x) [T, H]."""
    t0 = time.perf_counter()
    table = ex.table
    ahead = None if prefetch is None else expert_pb2.Prefetch(layer=prefetch[0], experts=prefetch[1])
    ex.step += 1
    native.rest()       # the workers are about to compute: this process's kernel threads leave them the cores
    # each `to` only where it converts: a no-op one still dispatches, ~1 µs warm and tens on the caches the layer's
    # attention weights have just flushed
    x, ids32, w32 = ex.staging.to_host(hidden if hidden.dtype == ex.wire_dtype else hidden.to(ex.wire_dtype),  # [T, H]
                                       ids if ids.dtype == torch.int32 else ids.to(torch.int32),                # [T, K]
                                       weights if weights.dtype == torch.float32 else weights.float())          # [T, K]
    # a failover re-sends from the host copies, and the window counts ids when the step closes: they must outlive
    # the (GPU) staging buffers, which the next layer reuses
    keep = (lambda t: t.clone()) if ex.staging.pinned else (lambda t: t)   # noqa: E731
    ids_kept = keep(ids32)
    ex.window.routed(layer, ids_kept)
    if ex.routed is not None:
        ex.routed[layer] += torch.bincount(ids32.flatten().long(), minlength=ex.cfg.num_experts)   # [E]
    parts: list[Part] = []
    W = table.holders.shape[2]
    live = ex.liveness.live()[:W]
    if table.explicit or not all(live):
        # each pair to one live holder of its expert, least-loaded first; tokens no live worker can
        # serve fail here, without a call
        placed = place(table.layer_holders[layer], ids32, live, holding=table.holding[layer])
        if placed.unplaced and _await_answering(ex, table, layer, ids32, placed.unplaced, live):
            live = ex.liveness.live()[:W]
            placed = place(table.layer_holders[layer], ids32, live, holding=table.holding[layer])
        if placed.unplaced:
            out = [f"{a}: {REFUSES if w in ex.kept_out else ex.liveness.why_not_live(w)}"
                   for w, (a, ok) in enumerate(zip(ex.addresses, live, strict=False)) if not ok]
            raise ExpertsUnavailable(f"the experts some tokens need have no live worker (not sent to: "
                                     f"{'; '.join(out) or 'none'})", torch.tensor(placed.unplaced))
        every: tuple[expert_pb2.Tensor, expert_pb2.Tensor] | None = None   # x, weights: once for all rows
        for wp in placed.parts:
            xr, wts = (x, w32) if wp.rows is None else (x.index_select(0, wp.rows), w32.index_select(0, wp.rows))
            reply = _send_serialized(ex, table, layer, wp.worker, (xr, wp.ids, wts), explicit=True) \
                if ahead is None else None
            if reply is not None:                                        # the same-host socket: serialized natively
                _count(ex, wp.worker, wp.ids.shape[0], wp.pairs)
            else:
                if wp.rows is None:
                    every = every or (wire.encode(x), wire.encode(w32))
                hx, hw = every if wp.rows is None else (wire.encode(xr), wire.encode(wts))
                req = request(ex, table, layer, hx, wire.encode(wp.ids), hw, ahead)
                reply = _send(ex, wp.worker, req, wp.ids.shape[0], wp.pairs)
            parts.append(Part(wp.worker, wp.rows, reply, placed.assigned))
    else:
        whole: tuple[expert_pb2.Tensor, ...] | None = None               # encoded once, sent to all
        for wr in partition(table.owner_lists[layer], ids32, W):
            reply = _send_serialized(ex, table, layer, wr.worker, (x, ids32, w32), wr.rows) if ahead is None else None
            if reply is None:                                            # a gRPC link, or a prefetch hint
                # index_select, never x[rows]: advanced indexing of a few rows starts an OpenMP region, ~0.07 ms
                # on an idle CPU and ~1 ms while the workers hold the cores
                rows = (x, ids32, w32) if wr.rows is None else \
                    tuple(t.index_select(0, wr.rows) for t in (x, ids32, w32))
                if wr.rows is None:
                    whole = whole or tuple(wire.encode(t) for t in rows)
                enc = whole if wr.rows is None else tuple(wire.encode(t) for t in rows)
                reply = ex.links.links[wr.worker].send(request(ex, table, layer, *enc, ahead,
                                                               holds=table.digests[wr.worker]))
            parts.append(Part(wr.worker, wr.rows, reply, None))
            _count(ex, wr.worker, x.shape[0] if wr.rows is None else wr.rows.numel(), wr.pairs)
    ex.timers["dispatch"] += time.perf_counter() - t0
    return InFlight(ex, table, layer, hidden, keep(x), ids_kept, keep(w32), parts)


def _await_answering(ex: Dispatching, table: Table, layer: int, ids32: torch.Tensor, unplaced: list[int],
                     live: list[bool]) -> bool:
    """Whether the workers that hold the experts no live worker holds for `unplaced` rows, and that are down by
    their health checks' timeouts yet answered a call this past second (paused, then resumed), are live again
    within 3 s (--worker-timeout if shorter): the checks see them back in a round or two, and their requests go
    on rather than fail as they return. Not while a placement change waits for this step, nor for a worker a
    re-sync found refusing."""
    if ex.switch_pending:
        return False
    lost = table.holders_of_lost(layer, ids32.index_select(0, torch.tensor(unplaced)), live)   # [W]
    back = [w for w in ex.liveness.answering(live) if w < lost.numel() and lost[w] and w not in ex.kept_out]
    if not back:
        return False
    ex.waiting()                                   # the last step's events go out meanwhile
    return ex.liveness.await_live(back, ex.sync_wait_s)


def send(ex: Dispatching, table: Table, w: int, layer: int, x: torch.Tensor, ids: torch.Tensor,
         weights: torch.Tensor, pairs: int, ahead: expert_pb2.Prefetch | None = None) -> Reply:
    """Worker w's share of a layer, already cut to its rows ([n, H], [n, K] with -1 for pairs computed
    elsewhere, [n, K]), `pairs` of them (ids >= 0); `ahead` the next layer's predicted experts (a failover
    re-send carries none)."""
    req = request(ex, table, layer, wire.encode(x), wire.encode(ids), wire.encode(weights), ahead)
    return _send(ex, w, req, x.shape[0], pairs)


def _send_serialized(ex: Dispatching, table: Table, layer: int, w: int, tensors: tuple[torch.Tensor, ...],
                     rows: torch.Tensor | None = None, explicit: bool = False) -> Reply | None:
    """Worker w's share of a layer (`rows` of hidden [T, H], ids [T, K] int32 and weights [T, K], None: all T; the
    whole top-k of its rows under a static plan, or with `explicit` its pairs, others' ids -1) serialized and written
    natively, the rows gathered as they are written, where its link sends frames (the same-host socket); None where
    it does not (then the message, as `request` makes it)."""
    link = ex.links.links[w]
    if not link.local or not native.available():
        return None
    holds, step = 0 if explicit else table.digests[w], ex.step
    return link.send_written(lambda sock: native_wire.forward_send(sock.fileno(), *tensors, rows, layer, step,
                                                                   table.epoch, holds, ex.checkpoint_id, explicit),
                             layer)


def request(ex: Dispatching, table: Table, layer: int, hidden: expert_pb2.Tensor, ids: expert_pb2.Tensor,
            weights: expert_pb2.Tensor, ahead: expert_pb2.Prefetch | None,
            holds: int | None = None) -> expert_pb2.ForwardRequest:
    """One layer's message: explicit pairs (others' ids -1), or with `holds` (the digest of the experts planned
    on that worker) the whole top-k of a static plan."""
    return expert_pb2.ForwardRequest(layer=layer, hidden=hidden, topk_ids=ids, topk_weights=weights,
                                     step=ex.step, prefetch=ahead, exact_sum=True, epoch=table.epoch,
                                     checkpoint=ex.checkpoint_id, explicit=holds is None, holds=holds or 0)


def _send(ex: Dispatching, w: int, req: expert_pb2.ForwardRequest, rows: int, pairs: int) -> Reply:
    """Send worker w its request of `rows` token rows and `pairs` token-expert pairs, counted as sent."""
    _count(ex, w, rows, pairs)
    return ex.links.links[w].send(req)


def _count(ex: Dispatching, w: int, rows: int, pairs: int) -> None:
    """Worker w was sent `rows` token rows and `pairs` token-expert pairs (metrics, and the load window)."""
    ex.worker_rows[w] += rows
    ex.window.computed(ex.addresses[w], pairs)
