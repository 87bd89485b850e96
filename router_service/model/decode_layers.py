"""A decode step's MoE layers as one loop of native `decoder_layer` calls, their arguments bound once.

At one row a decode step is a few native calls a layer apart, and the Python between them ran on caches the
weights' stream had just flushed: the checks that a layer may fuse, the experts' plan, the mapped files' check and
a list of ~40 arguments took ~90 µs a layer on the 2-core EPYC (0.7 ms of a 14 ms step, timed around the calls).
A `DecodePlan` holds each layer's call with the arguments that stay the same step after step (weights, norms,
routing, the experts' blocks and map, the layer's KV cache); a step checks, by identity, that the layers' weights,
the experts' plan and the KV cache are the ones it was made from, and calls. RouterModel makes one per (rows,
dtype) on the first decode step that may use it (`RouterModel._decode_plan`), and again when any of them changed
(the weights moved onto huge pages, the experts repacked).
"""

from __future__ import annotations

import operator
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

    def fits(self, layers: tuple[LayerWeights, ...], moes: tuple[native.LayerExperts | None, ...], kv: KVCache
             ) -> bool:
        """Whether it was made from these very layer weights, experts and KV cache."""
        return (moes is self.moes and kv.k is self.kv[0] and kv.v is self.kv[1] and len(layers) == len(self.weights)
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
