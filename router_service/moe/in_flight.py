"""One MoE layer of one micro-batch on its way to the workers: the replies, the failover of a worker that fails
within the step, and the combine of the partial sums (moe/remote.py sends; this waits and adds).

Shapes: T tokens in the step, H hidden size, K experts per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from colibri_common import wire
from colibri_common.frames import Payload, payload_bytes
from colibri_common.metrics_http import QueuedHistogram
from colibri_common.pb import expert_pb2
from kernels import native, native_wire
from router_service.moe.combine import combine
from router_service.moe.experts import ExpertsUnavailable
from router_service.moe.liveness import Liveness
from router_service.moe.partition import Placement, place
from router_service.moe.table import Table
from router_service.moe.transport import Reply, WorkerError

# one worker's answer to a layer: (worker, its rows or None for all, the reply's bytes or the parsed reply)
Answer = tuple[int, torch.Tensor | None, Payload | expert_pb2.ForwardResponse]


class Sender(Protocol):
    """What a layer in flight needs of the experts client that sent it (remote.RemoteExperts)."""

    addresses: list[str]
    liveness: Liveness
    dispatch_seconds: QueuedHistogram

    def failed(self, w: int, why: str, unsynced: bool = False) -> None: ...

    def await_sync(self, w: int) -> bool: ...

    def saw(self, address: str, instance: str, layer: int | None = None) -> None: ...

    def send(self, table: Table, w: int, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
             pairs: int) -> Reply: ...

    def count(self, **seconds: float) -> None: ...

    def waiting(self) -> None: ...


@dataclass(frozen=True)
class Part:
    """One message of a layer on its way: its worker, its token rows (None = all), the reply, and which worker
    each token-expert pair was sent to (`assigned` [T, K], a tensor or lists, from `place`: the message carries
    the pairs of its worker; None = the worker's experts among its rows)."""

    worker: int
    rows: torch.Tensor | None
    reply: Reply
    assigned: torch.Tensor | list[list[int]] | None


class InFlight:
    """One MoE layer of one micro-batch: the replies on their way from the workers, combined on `result`.
    A worker whose reply fails is banned and its pairs are sent again to live replicas (failover within the
    step: the sum, and so every token, is the same). It keeps the placement table it was sent under: a switch
    waits for the step to end, so its holders hold their experts until it is combined."""

    def __init__(self, owner: Sender, table: Table, layer: int, hidden: torch.Tensor, wire_x: torch.Tensor,
                 ids32: torch.Tensor, w32: torch.Tensor, parts: list[Part]) -> None:
        self.owner, self.table, self.layer, self.parts = owner, table, layer, parts
        self.x, self.ids32, self.w32 = wire_x, ids32, w32            # host copies: [T, H], [T, K], [T, K]
        self.sent = time.perf_counter()
        self.awaited: set[int] = set()                 # workers this layer waited on a re-sync for (once each)
        self.num_tokens, self.hidden_size = hidden.shape
        self.dtype, self.device = hidden.dtype, hidden.device

    def done(self) -> bool:
        return all(p.reply.done() for p in self.parts)

    def _pairs_of(self, part: Part) -> torch.Tensor:
        """[T, K] the pairs that very message carried (each message knows its own: after a failover a worker
        may hold two messages of one layer, whose rows overlap)."""
        if part.assigned is not None:
            return torch.as_tensor(part.assigned) == part.worker                           # [T, K]
        held = self.table.holders[self.layer, :, part.worker][self.ids32.long().clamp(min=0)] & (self.ids32 >= 0)
        if part.rows is None:                                                              # [T, K]
            return held
        mask = torch.zeros_like(held)
        mask[part.rows] = held[part.rows]
        return mask

    def _failover(self, part: Part, exc: WorkerError) -> list[Part]:
        self.owner.failed(part.worker, str(exc), exc.unsynced)
        pairs = self._pairs_of(part)
        placed = self._place(pairs)
        if placed.unplaced and exc.unsynced and part.worker not in self.awaited:
            self.awaited.add(part.worker)
            if self.owner.await_sync(part.worker):
                placed = self._place(pairs)    # up, re-synced: it takes its pairs again (no replica held them)
        if placed.unplaced:
            raise ExpertsUnavailable(f"{exc}; no live replica holds the experts some tokens need",
                                     torch.tensor(placed.unplaced)) from exc
        return [Part(wp.worker, wp.rows,
                     self.owner.send(self.table, wp.worker, self.layer, self._rows(self.x, wp.rows), wp.ids,
                                     self._rows(self.w32, wp.rows), wp.pairs), placed.assigned)
                for wp in placed.parts]

    def _place(self, pairs: torch.Tensor) -> Placement:
        W = self.table.holders.shape[2]
        return place(self.table.holders[self.layer], self.ids32, self.owner.liveness.live()[:W], pairs,
                     self.table.holding[self.layer])

    @staticmethod
    def _rows(t: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        return t if rows is None else t.index_select(0, rows)

    def result(self) -> torch.Tensor:
        return self._finish(*self._collect())

    def replies(self) -> torch.Tensor | Replies:
        """The replies unsummed where each is a same-host socket's bytes (the next layer's native front sums them),
        else `result()`."""
        got, t_start, waited = self._collect()
        if all(isinstance(a, torch.Tensor) for _, _, a in got):
            self.owner.count(wait=waited, dispatch=time.perf_counter() - t_start - waited)
            return Replies(self, got)
        return self._finish(got, t_start, waited)

    def _collect(self) -> tuple[list[Answer], float, float]:
        """Every reply (failing over where a worker fails): (the answers, when this began, the seconds waited)."""
        t_start, waited = time.perf_counter(), 0.0
        if rested := not self.done():
            native.rest()   # this process waits now: its kernel threads leave the cores to the workers
            self.owner.waiting()     # ... and its stream handlers may have the GIL (the engine's outbox)
        got: list[Answer] = []
        todo = list(self.parts)
        while todo:
            part = todo.pop(0)
            t0 = time.perf_counter()
            try:
                if (answer := part.reply.get_bytes()) is None:          # bytes off a same-host socket, or parsed
                    answer = part.reply.get()
            except WorkerError as exc:
                waited += time.perf_counter() - t0
                self._saw(got)       # restarts seen before the ban, which records the process it bans
                if not exc.retryable:
                    raise
                todo += self._failover(part, exc)
                continue
            waited += time.perf_counter() - t0
            if not self.owner.liveness.healthy[part.worker]:     # it answers, whatever its checks said
                self.owner.liveness.answered(part.worker)
            self.owner.dispatch_seconds.observe(time.perf_counter() - self.sent, self.owner.addresses[part.worker])
            got.append((part.worker, part.rows, answer))
            if rested and len(got) == 1 and todo:   # another reply to come: the kernel threads get up on the
                native.wake()                      # core this worker left, for the step's next op
        return got, t_start, waited

    def _finish(self, got: list[Answer], t_start: float, waited: float) -> torch.Tensor:
        out, computed = self._combine(got)
        self.owner.count(wait=waited, expert_compute=computed,
                         dispatch=time.perf_counter() - t_start - waited)
        return out if out.device == self.device else out.to(self.device)                      # [T, H]

    def _saw(self, got: list[Answer]) -> None:
        """Tell the owner which process answered each reply so far (a failover's path: the bytes parsed here)."""
        for worker, _, answer in got:
            self.owner.saw(self.owner.addresses[worker], _response(answer).instance, self.layer)

    def _combine(self, got: list[Answer]) -> tuple[torch.Tensor, float]:
        """The answers' sum [T, H] (in the order they came, the bits of `combine`) and their compute seconds: read
        natively where every answer is bytes (kernels/native/combine_op.cpp), else parsed and decoded here."""
        raw = [a for _, _, a in got if not isinstance(a, expert_pb2.ForwardResponse)]
        native_sum = native_wire.combine_replies(raw, [rows for _, rows, _ in got], self.num_tokens, self.hidden_size,
                                            self.dtype) if len(raw) == len(got) else None
        if native_sum is not None:
            out, ms, instances = native_sum
            for (worker, _, _), instance in zip(got, instances, strict=True):
                self.owner.saw(self.owner.addresses[worker], instance, self.layer)
            return out, sum(ms) / 1e3
        parsed = [(worker, rows, _response(answer)) for worker, rows, answer in got]
        self._saw(parsed)
        return (combine(self.num_tokens, self.hidden_size, self.dtype,
                        [(rows, wire.decode(resp.output)) for _, rows, resp in parsed]),          # [n, H] each
                sum(resp.compute_ms for _, _, resp in parsed) / 1e3)


class Replies:
    """A layer's replies as the same-host socket's bytes, not summed yet (`InFlight.replies`; the next layer's native
    front sums them, with the bits of `result`). Summed there, the replies' processes are not looked at: the step's
    last MoE layer, summed by `result`, tells them (a worker that restarts within a step breaks its connection)."""

    def __init__(self, flight: InFlight, got: list[Answer]) -> None:
        self.flight, self.got = flight, got
        self.payloads: list[torch.Tensor] = [a for _, _, a in got]  # type: ignore[misc]
        self.rows = [rows for _, rows, _ in got]

    def sum(self) -> torch.Tensor:
        t0 = time.perf_counter()
        return self.flight._finish(self.got, t0, 0.0)

    def summed(self, compute_ms: list[float]) -> None:
        self.flight.owner.count(expert_compute=sum(compute_ms) / 1e3)


def _response(answer: Payload | expert_pb2.ForwardResponse) -> expert_pb2.ForwardResponse:
    return answer if isinstance(answer, expert_pb2.ForwardResponse) else \
        expert_pb2.ForwardResponse.FromString(payload_bytes(answer))
