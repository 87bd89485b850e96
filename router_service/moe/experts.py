"""The routed experts of one MoE layer, as the model sees them: `submit(layer, x, ids, weights) -> handle`.

The pipeline is named once: **route** (the gate and top-k, in `model.py`) → **partition** (which rows go to
which worker, `partition.py`) → **transport** (gRPC to the workers, `transport.py`) → **combine**
(the partial sums back into one tensor, `combine.py`). `RemoteExperts` (remote.py) strings the last
three together, one `InFlight` (in_flight.py) per layer on its way; `LocalExperts` computes in the router's own
process (`colibri.LLM(workers=0)`).

Shapes: T tokens in the step, H hidden size, K experts per token (top-k), E experts per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
from prometheus_client.core import Metric

from kernels import native


class Unsummed(Protocol):
    """A MoE layer's replies received but not summed yet (the same-host socket's bytes, `Handle.replies`): the next
    layer's native front sums them into its input (kernels.native.decoder_front_sum), else `sum()` does it."""

    payloads: list[torch.Tensor]          # each reply's bytes, uint8 [B]
    rows: list[torch.Tensor | None]       # each reply's token rows (int64 [n]), None = every row

    def sum(self) -> torch.Tensor:
        """The layer's result [T, H], as `Handle.result` gives it."""
        ...

    def summed(self, compute_ms: list[float]) -> None:
        """The native front summed them: each reply's compute_ms, for the experts' timers."""
        ...


class Handle(Protocol):
    def result(self) -> torch.Tensor: ...

    def replies(self) -> torch.Tensor | Unsummed:
        """`result`, or where the next layer's native front can sum the replies, the replies unsummed."""
        ...

    def done(self) -> bool:
        """Whether the result is computed already (result() would not wait)."""
        ...


Prefetch = tuple[int, list[int]]          # (the next MoE layer, the global expert ids it will probably need)


class Experts(Protocol):
    """Σ_k w_k · FFN_{e_k}(x) per token for one MoE layer, maybe computed elsewhere, and everything the engine,
    the router's build and its server ask of them. `prefetch`, when given, is the router's prediction for the
    next MoE layer: the experts' holders may pack them ahead."""

    timers: dict[str, float]       # seconds by phase (wait, expert_compute, dispatch); empty where none are kept

    @property
    def capturable(self) -> bool:
        """Whether `submit` may be recorded in a CUDA graph (router_service/model/decode_graphs.py): computed in
        this process on the GPU, every expert resident, nothing read on the host. A replay runs no Python: a
        wrapper whose `submit` does something on the host (fault injection, counting) must say False."""
        ...

    def submit(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               prefetch: Prefetch | None = None) -> Handle: ...

    def native_layer(self, layer: int, hidden: torch.Tensor) -> native.LayerExperts | None:
        """The layer's experts as one native call of the whole decoder layer takes them (in this process, on the
        CPU, the native expert FFN: `kernels.native.decoder_layer`), for hidden [T, H]; None where `submit` must
        run: remote experts, an expert cache, torch's forms, or a wrapper whose `submit` does something on the
        host (as for `capturable`, it must say None)."""
        ...

    def native_layers(self, hidden: torch.Tensor) -> tuple[native.LayerExperts | None, ...] | None:
        """`native_layer` of every layer at once (by layer index), for a decode step's hidden [T, H], checked once:
        the same tuple object while the experts stay as they are (the model's decode plan compares it by identity),
        or None where no layer's may be taken (as `native_layer` says None)."""
        ...

    def metric_families(self) -> Iterator[Metric]:
        """Their own Prometheus families (per worker: rows, liveness, bans); none in-process."""
        ...

    def watch(self, on_change: Callable[[bool], None]) -> None:
        """Call on_change(ok) whenever every expert gains (ok) or loses a live holder; in-process never."""
        ...

    def stepping(self, while_waiting: Callable[[], None]) -> contextlib.AbstractContextManager[None]:
        """Held by the engine around each step's forward: placement changes happen only between steps.
        `while_waiting` is called when the step is first about to block on experts computed elsewhere (a
        worker's reply), and at once where it never will: the engine delivers the last step's events then, so
        the stream handlers' Python runs while its thread holds no GIL (router_service/engine/outbox.py)."""
        ...

    def close(self) -> None: ...


class Shard(Protocol):
    """What LocalExperts needs of the experts it holds (expert_service.shard.ExpertShard)."""

    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor: ...

    def hint(self, layer: int, experts: list[int]) -> None: ...

    def native_layer(self, layer: int, hidden: torch.Tensor) -> native.LayerExperts | None: ...

    def native_layers(self, hidden: torch.Tensor) -> tuple[native.LayerExperts | None, ...] | None: ...

    @property
    def capturable(self) -> bool: ...


class Ready:
    """A handle whose result is already computed (in-process experts)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def result(self) -> torch.Tensor:
        return self.value

    def replies(self) -> torch.Tensor:
        return self.value

    def done(self) -> bool:
        return True


class LocalExperts:
    """Every expert in the router's own process: no gRPC, no phases timed, no metrics of their own, always
    ready; closing them leaves the shard to its owner."""

    def __init__(self, shard: Shard) -> None:
        self.shard = shard
        self.timers: dict[str, float] = {}

    @property
    def capturable(self) -> bool:
        return self.shard.capturable

    def submit(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
               prefetch: Prefetch | None = None) -> Ready:
        out = self.shard.forward(layer, hidden, ids, weights).to(hidden.dtype)
        if prefetch is not None:
            self.shard.hint(*prefetch)
        return Ready(out)

    def native_layer(self, layer: int, hidden: torch.Tensor) -> native.LayerExperts | None:
        if type(self).submit is not LocalExperts.submit:   # a subclass's own submit (fault injection) must run
            return None
        return self.shard.native_layer(layer, hidden)

    def native_layers(self, hidden: torch.Tensor) -> tuple[native.LayerExperts | None, ...] | None:
        if type(self).submit is not LocalExperts.submit:
            return None
        return self.shard.native_layers(hidden)

    def metric_families(self) -> Iterator[Metric]:
        return iter(())

    def watch(self, on_change: Callable[[bool], None]) -> None:
        pass                                       # every expert is here: readiness never changes

    def stepping(self, while_waiting: Callable[[], None]) -> contextlib.AbstractContextManager[None]:
        while_waiting()                            # nothing is ever waited for here: the events go now
        return contextlib.nullcontext()            # placement never changes in-process

    def close(self) -> None:
        pass


class ExpertsUnavailable(Exception):
    """Some tokens of a micro-batch need experts that no live worker holds: `rows` [n] are those token rows
    (the engine fails the requests they belong to and runs the step again for the others)."""

    def __init__(self, message: str, rows: torch.Tensor) -> None:
        super().__init__(message)
        self.rows = rows
        self.micro_batch = 0
