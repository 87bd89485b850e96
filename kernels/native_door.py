"""A worker's same-host connections served in native code (kernels/native/door_op.cpp): a connection's thread reads,
answers and writes the plain calls of a `colibri serve` fleet without entering Python, from a table of the experts
the worker publishes (`Door.publish`), and returns to Python only with the frames it does not answer.

What a table holds, per MoE layer, is what `native_wire.expert_answer` takes (its answers are that op's bytes), plus
the descriptors and identities of the files its experts are read from in place, which it checks before each read as
`FileWatch.stale` does. Publishing a table returns once no call computes on the one it replaces: the experts of that
one may then be unmapped.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from kernels.formats.int8 import Int8Weight
from kernels.native import LayerExperts, _blocks, available
from kernels.native_wire import FRAME_CLOSED, FRAME_CUT, FRAME_OVER, X_DTYPES, _signed64

__all__ = ["FRAME_CLOSED", "FRAME_CUT", "FRAME_OVER", "Door", "DoorLayer", "DoorStats", "DoorTable"]


@dataclass(frozen=True)
class DoorLayer:
    """One MoE layer's experts, and the (descriptor, size, mtime_ns) of each file they are read from in place."""

    layer: int
    experts: LayerExperts
    files: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class DoorTable:
    """What the door answers: calls under `epochs` (and `holds` == `digest` or 0) of the router's `checkpoint` (0: not
    checked) for hidden states in `dtype`, on `layers`; each reply names `instance`."""

    dtype: torch.dtype
    hidden_size: int
    num_experts: int
    epochs: tuple[int, ...]
    digest: int
    checkpoint: int
    instance: str
    layers: tuple[DoorLayer, ...]

    def __post_init__(self) -> None:
        if self.dtype not in X_DTYPES:
            raise ValueError(f"a door answers float32 or bfloat16 hidden states, not {self.dtype}")
        for d in self.layers:
            emap = d.experts.expert_map
            if emap is None or emap.numel() != self.num_experts:
                raise ValueError(f"layer {d.layer}: a door needs the map of all {self.num_experts} experts")


@dataclass(frozen=True)
class DoorStats:
    """The calls a door answered: how many, their token rows, their compute seconds in all and per bucket (the
    counts of each of the door's bounds and then +Inf, not cumulative)."""

    calls: int
    rows: int
    seconds: float
    counts: tuple[int, ...]


class Door:
    """One worker's native door (None of it without the library: check `available()` first). `bounds`: the compute
    histogram's buckets (the worker's metrics add the door's calls to the Python path's)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if not available():
            raise RuntimeError("the native kernels are not loaded: no native door")
        self.bounds = tuple(bounds)
        self.id = torch.ops.colibri.door_open(list(self.bounds))
        self._held: tuple[object, ...] = ()      # the published table's expert registrations (their numbers live)

    def publish(self, table: DoorTable | None) -> None:
        """Answer from `table` from now on (None: no call), once no call computes on the table before."""
        layers = () if table is None else table.layers
        held = tuple(b for d in layers for b in (_blocks(d.experts.w13), _blocks(d.experts.w2)))
        ex = [d.experts for d in layers]
        files = [(d.layer, *f) for d in layers for f in d.files]
        torch.ops.colibri.door_publish(
            self.id, table is not None, X_DTYPES[table.dtype] if table else 0, table.hidden_size if table else 0,
            table.num_experts if table else 0, list(table.epochs) if table else [],
            _signed64(table.digest) if table else 0, _signed64(table.checkpoint) if table else 0,
            table.instance if table else "", [d.layer for d in layers],
            [e.expert_map if e.expert_map.dtype == torch.int64 else e.expert_map.long() for e in ex],  # type: ignore[union-attr]
            [b.id for b in held[0::2]], [b.id for b in held[1::2]], [e.b13 for e in ex], [e.b2 for e in ex],
            [e.act.alpha for e in ex], [math.nan if e.act.limit is None else e.act.limit for e in ex],
            [e.act.up_offset for e in ex], [int(_w8a8(e)) for e in ex],
            [f[0] for f in files], [f[1] for f in files], [f[2] for f in files], [f[3] for f in files])
        self._held = held                        # the table before is no longer read: its numbers may go

    def serve(self, fd: int, limit: int) -> tuple[int, int, torch.Tensor]:
        """Serve the connected socket `fd` until a frame for Python (code >= 0, its status byte; size; payload uint8
        [size]) or its end (code < 0: -errno, FRAME_CLOSED, FRAME_CUT, or FRAME_OVER with the size over `limit`)."""
        return torch.ops.colibri.door_serve(self.id, fd, limit)

    def write(self, fd: int, status: int, reply: bytes | bytearray | memoryview) -> None:
        """Python's answer to a frame `serve` returned, written as one frame (reading what the router writes
        meanwhile); OSError where the socket refuses it."""
        data = torch.frombuffer(bytearray(reply), dtype=torch.uint8) if len(reply) else _EMPTY
        if (rc := torch.ops.colibri.door_write(self.id, fd, status, data)) < 0:
            raise OSError(-rc, os.strerror(-rc))

    def forget(self, fd: int) -> None:
        """The connection on `fd` is closing: its bytes read ahead are dropped (before the descriptor is closed)."""
        torch.ops.colibri.door_forget(self.id, fd)

    def stats(self) -> DoorStats:
        calls, rows, seconds, counts = torch.ops.colibri.door_stats(self.id)
        return DoorStats(calls, rows, seconds, tuple(counts.tolist()))

    def close(self) -> None:
        """No call is answered here any more (once the ones computing end); the door is freed."""
        self.publish(None)
        torch.ops.colibri.door_free(self.id)


def _w8a8(e: LayerExperts) -> bool:
    return isinstance(e.w13, Int8Weight) and e.w13.w8a8


_EMPTY = torch.empty(0, dtype=torch.uint8)
