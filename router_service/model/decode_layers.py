"""A decode step's MoE layers as one loop of native `decoder_layer` calls, their arguments bound once.

At one row a decode step is a few native calls a layer apart, and the Python between them ran on caches the
weights' stream had just flushed: the checks that a layer may fuse, the experts' plan, the mapped files' check and
a list of ~40 arguments took ~90 µs a layer on the 2-core EPYC (0.7 ms of a 14 ms step, timed around the calls).
A `DecodePlan` holds each layer's call with the arguments that stay the same step after step (weights, norms,
routing, the experts' blocks and map, the layer's KV cache); a step checks, by identity, that the layers' weights,
the experts' plan and the KV cache are the ones it was made from, and calls. The router's model makes one per
(rows, dtype) on the first decode step that may use it (`Fusion.decode_plan` in fusion.py, `make_plan`), and again
when any of them changed (the weights moved onto huge pages, the experts repacked); `LayerCaches` holds the plans
with the other things made once for the layers' weights, and drops them all when the weights have moved.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import native
from router_service.model.kv_cache import KVCache
from router_service.model.step_inputs import StepInputs
from router_service.model.weights import LayerWeights


@dataclass(frozen=True)
class LayerCall:
    call: native.DecoderLayerCall
    k: torch.Tensor             # [S, Hkv, D] the layer's KV cache
    v: torch.Tensor
    sliding: bool               # reads the sliding window's slots


@dataclass(frozen=True)
class DecodePlan:
    weights: tuple[LayerWeights, ...]                            # what it was made from, compared by identity
    moes: tuple[native.LayerExperts | None, ...]
    kv: tuple[torch.Tensor, torch.Tensor]
    calls: tuple[LayerCall, ...] | None                          # None: not every layer fuses (kept, so a step
                                                                 # does not ask again)

    def fits(self, layers: tuple[LayerWeights, ...], moes: tuple[native.LayerExperts | None, ...],
             kv: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """Whether it was made from these very layer weights, experts and KV cache (k, v)."""
        return (moes is self.moes and kv[0] is self.kv[0] and kv[1] is self.kv[1] and len(layers) == len(self.weights)
                and all(map(operator.is_, layers, self.weights)))

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepInputs,
            routes: list[torch.Tensor] | None) -> torch.Tensor:
        """h [T, H] after every layer; each layer's routed ids [T, K] appended to `routes` where given."""
        assert self.calls is not None
        write, full = step.slots, (step.decode_slots, step.decode_lens)                      # [T], [Bd, C], [Bd]
        window = (step.decode_window_slots, step.decode_window_lens)
        for layer in self.calls:
            h, ids = layer.call(h, cos, sin, layer.k, layer.v, write, *(window if layer.sliding else full))
            if routes is not None:
                routes.append(ids)                                                          # [T, K]
        return h


def make_plan(layers: tuple[LayerWeights, ...], moes: tuple[native.LayerExperts | None, ...], kv: KVCache,
              sliding: frozenset[int],
              call_of: Callable[[int, LayerWeights, native.LayerExperts], native.DecoderLayerCall | None]
              ) -> DecodePlan:
    """A plan of every layer's call (`call_of`: None where a layer does not fuse, and then the plan has no calls)."""
    calls = []
    for i, lw in enumerate(layers):
        moe = moes[i] if i < len(moes) else None
        call = None if moe is None else call_of(i, lw, moe)
        if call is None:
            return DecodePlan(layers, moes, (kv.k, kv.v), None)
        calls.append(LayerCall(call, kv.k[i], kv.v[i], i in sliding))
    return DecodePlan(layers, moes, (kv.k, kv.v), tuple(calls))


class LayerCaches:
    """What the router model's engine thread keeps of the layers' weights between steps (fusion.py), made once (a
    layer's Python runs on caches the weights' stream has flushed): decode plans by (rows, dtype), the attention
    block's weight arguments and the routing check by layer. `forget` (any thread: the one that moves the weights
    onto huge pages, once it is done) drops them all, so none keeps the old copies alive; an entry made from weights
    read before that is not kept (`keep`'s epoch, under the lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.epoch = 0
        self.plans: dict[tuple[int, torch.dtype], DecodePlan] = {}
        self.block_parts: dict[int, tuple[LayerWeights, tuple, tuple]] = {}        # (weights, head, tail)
        self.routes: dict[int, tuple[LayerWeights, torch.dtype, bool, bool]] = {}  # (weights, dtype, native, ops)

    def keep(self, epoch: int, cache: dict, key: object, value: object) -> None:
        """cache[key] = value, unless `forget` ran since `epoch` was read (value may hold the old weights)."""
        with self._lock:
            if self.epoch == epoch:
                cache[key] = value

    def keep_plan(self, epoch: int, key: tuple[int, torch.dtype], plan: DecodePlan) -> None:
        """`keep` for a plan: the plans made from other weights, experts or cache (at any row count) go with it,
        since they must not keep the old ones alive."""
        with self._lock:
            if self.epoch == epoch:
                self.plans = {k: p for k, p in self.plans.items() if p.fits(plan.weights, plan.moes, plan.kv)}
                self.plans[key] = plan

    def forget(self) -> None:
        with self._lock:
            self.epoch += 1
            self.plans, self.block_parts, self.routes = {}, {}, {}
