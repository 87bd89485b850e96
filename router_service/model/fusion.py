"""Which parts of a CPU decode step run as one native call each, and the arguments those calls take.

A decode step of a CPU router with the native decoder ops (kernels/native.py) takes, from the widest to the
narrowest, as far as its layers allow:
- every layer as one loop of `decoder_layer` calls from a `DecodePlan` (decode_layers.py): each MoE layer's
  attention block, routing and experts in one call, where the experts are in this process (`decode_plan`);
- one layer at a time the same call, where some other layer does not fuse (`whole_layer`);
- the layer up to its experts (the attention block, the residual add, the routing) in one call (`front`), where the
  experts are elsewhere (a fleet's router) or the layer has shared experts;
- the attention block alone in one call (`fuses_attention`): a dense layer's, or one whose routing is not the one
  native call (a gate with a bias);
- the MoE block's front (norm, gate, routing) in one call (`native_route`), prefills included.
The rest (prefills' attention, latent attention, the GPU's path, batch invariance, weights whose form at the step's
rows is not the native one, clipped qkv) runs op by op in model.py, with the same bits.

The checks run on caches the layer's weights have just flushed, so what depends on the weights alone is worked out
once and kept by layer (`LayerCaches`, which `forget` empties when the weights move onto huge pages) and what
depends on the step once a step.
"""

from __future__ import annotations

import logging
from functools import partial

import torch

from colibri_common.config import ModelConfig
from kernels import Routing, backend_for, native, pick_rows
from router_service.model.decode_layers import DecodePlan, LayerCaches, make_plan
from router_service.model.kv_cache import KVCache
from router_service.model.layers import NORM_TYPES
from router_service.model.step_inputs import StepInputs
from router_service.model.weights import LayerWeights
from router_service.moe.experts import Experts, Unsummed

log = logging.getLogger("colibri.router")


class Fusion:
    def __init__(self, cfg: ModelConfig, routing: Routing, sliding: frozenset[int]) -> None:
        self.cfg = cfg
        self.routing = routing
        self.sliding = sliding
        self.fuse_attention = True     # decode steps' attention blocks in one native call where they may
        self.fuse_layers = True        # and whole MoE layers, where the experts are in this process
        self.caches = LayerCaches()     # plans, arguments and checks made once for the layers' weights
        self._weights_fuse: dict[tuple[int, int, torch.dtype], bool] = {}    # by (layer, rows, dtype)
        self._step_fuse: tuple[StepInputs | None, bool] = (None, False)       # the step part, for its step
        self._said = False
        self._epoch = 0         # the caches' epoch read just before the layer being run was (`read_layer`)

    @staticmethod
    def routes_natively(lw: LayerWeights, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a MoE layer's front (norm, gate, routing) is the one native call: on a CPU, not where the Triton
        backend runs the GPU's path (the interpreter, in tests), plain gate weights of the step's dtype."""
        return (device.type == "cpu" and backend_for(device) != "triton" and native.decoder_ops()
                and lw.gate_bias is None and isinstance(lw.gate, torch.Tensor) and lw.gate.dtype == dtype
                and (dtype, lw.ln2.dtype) in NORM_TYPES)

    def read_layer(self, weights: list[LayerWeights], layer: int) -> LayerWeights:
        """weights[layer], for a step's layer-by-layer path; what `native_route` and `block_args` keep for it is kept
        under the epoch read just before (another thread may replace the layer and then forget what was kept: an
        entry of the old one must not be kept after that)."""
        self._epoch = self.caches.epoch
        return weights[layer]

    def native_route(self, layer: int, lw: LayerWeights, h: torch.Tensor) -> bool:
        """`routes_natively` for this layer at h's dtype, worked out once for the layer's weights (and again where
        the decoder ops were refused since: the torch forms at once)."""
        known, ops = self.caches.routes.get(layer), native.decoder_ops()
        if known is None or known[0] is not lw or known[1] != h.dtype or known[3] != ops:
            known = (lw, h.dtype, self.routes_natively(lw, h.dtype, h.device), ops)
            self.caches.keep(self._epoch, self.caches.routes, layer, known)
        return known[2]

    def decode_plan(self, weights: list[LayerWeights], h: torch.Tensor, cos: torch.Tensor, step: StepInputs,
                    kv: KVCache, experts: Experts, invariant: bool) -> DecodePlan | None:
        """Every layer of this decode step as a loop of native decoder_layer calls, where each layer would take
        `whole_layer`'s one call; None where some layer runs otherwise. Made once per (rows, dtype) and kept while
        the layers' weights (`weights`, read once here), the experts' plan and the KV cache are the same objects.
        `invariant`: batch invariance (then no plan: each row runs alone)."""
        if not self.fuse_layers or not self._step_fuses(h, cos, step, kv, invariant):
            return None
        moes = experts.native_layers(h)                  # checks the experts' mapped files, as native_layer does
        if moes is None:
            return None
        # the epoch before the snapshot: another thread may replace a layer (huge pages) and then forget the plans,
        # and a plan made from layers read before that must not be kept
        epoch, key = self.caches.epoch, (h.shape[0], h.dtype)
        layers = tuple(weights)
        plan = self.caches.plans.get(key)
        if plan is None or not plan.fits(layers, moes, (kv.k, kv.v)):
            plan = make_plan(layers, moes, kv, self.sliding, partial(self._layer_call, h))
            self.caches.keep_plan(epoch, key, plan)
        return plan if plan.calls is not None else None

    def _layer_call(self, h: torch.Tensor, layer: int, lw: LayerWeights, moe: native.LayerExperts
                    ) -> native.DecoderLayerCall | None:
        """A decode plan's call of this layer at h's rows and dtype, or None where it does not fuse."""
        if (lw.gate is None or lw.mla is not None or lw.mlp_gate_up is not None
                or not self._weights_fuse_at(layer, lw, h.shape[0], h.dtype)
                or not self.routes_natively(lw, h.dtype, h.device)):
            return None
        return native.DecoderLayerCall(self._block_head(lw), self._block_tail(lw), lw.ln2, lw.gate, self.routing,
                                       lw.gate_correction, moe)

    def whole_layer(self, layer: int, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    step: StepInputs, kv: KVCache, experts: Experts, invariant: bool
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A MoE layer of a decode step in one native call (kernels.native.decoder_layer: the attention block, the
        routing and the experts, with the bits of the three calls), where the experts are in this process on the
        native expert FFN (`experts.native_layer`): (h after the layer [T, H], the routed ids [T, K]); None where the
        layer runs call by call (prefills, shared experts, latent attention, experts elsewhere)."""
        if not self.fuse_layers or lw.gate is None or lw.mla is not None or lw.mlp_gate_up is not None:
            return None
        moe = experts.native_layer(layer, h)      # first: None at once for workers, so the fleet's router does not
        if (moe is None or not self.fuses_attention(layer, lw, h, cos, step, kv, invariant)   # check twice a layer
                or not self.routes_natively(lw, h.dtype, h.device)):
            return None
        return native.decoder_layer(h, self.block_args(layer, lw, cos, sin, step, kv), lw.ln2, lw.gate,
                                    self.routing, lw.gate_correction, moe)

    def front(self, layer: int, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              step: StepInputs, kv: KVCache, invariant: bool, carry: Unsummed | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A MoE layer of a decode step up to its experts in one native call (kernels.native.decoder_front: the
        attention block, the residual add and the routing, with the bits of those calls), where `whole_layer` does
        not take the layer (experts on workers, shared experts): (h after attention [T, H], the MoE block's input r
        [T, H], weights [T, K] float32, ids [T, K]); None where the layer's front runs call by call (and `carry` is
        left to the caller). `carry`: the last MoE layer's replies, added to h first (in the same call where the
        kernels read them: decoder_front_sum)."""
        if (lw.gate is None or lw.mla is not None or not self.fuses_attention(layer, lw, h, cos, step, kv, invariant)
                or not self.native_route(layer, lw, h)):
            return None
        args = self.block_args(layer, lw, cos, sin, step, kv)
        if carry is not None:
            got = native.decoder_front_sum(carry.payloads, carry.rows, h, args, lw.ln2, lw.gate, self.routing,
                                           lw.gate_correction)
            if got is not None:
                carry.summed(got[4])
                return got[:4]
            h = h + carry.sum()                                  # the Python path, which says what is wrong
        return native.decoder_front(h, args, lw.ln2, lw.gate, self.routing, lw.gate_correction)

    def fuses_attention(self, layer: int, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, step: StepInputs,
                        kv: KVCache, invariant: bool) -> bool:
        """Whether this layer's attention block may run as one native call (kernels.native.attention_block, the
        bits of the op-by-op path): a CPU step of decode rows only, not the GPU's path (the Triton backend, which
        the interpreter runs on a CPU in tests), no batch-invariant mode, plain float weights whose linear form
        here is the native one, and no clipped qkv."""
        if self._step_fuse[0] is not step:              # once a step (a layer's Python runs on cold caches)
            self._step_fuse = (step, self._step_fuses(h, cos, step, kv, invariant))
        return self._step_fuse[1] and self._weights_fuse_at(layer, lw, h.shape[0], h.dtype)

    def _step_fuses(self, h: torch.Tensor, cos: torch.Tensor, step: StepInputs, kv: KVCache, invariant: bool
                    ) -> bool:
        """`fuses_attention`'s part that is the step's, the same for every layer."""
        T, dtype = h.shape[0], h.dtype
        return (self.fuse_attention and not invariant and step.num_decode == T and T > 0
                and not step.prefills and h.device.type == "cpu" and backend_for(h.device) != "triton"
                and native.decoder_ops()
                and self.cfg.clip_qkv is None and cos.dtype == dtype and kv.k.dtype == dtype
                and kv.v.shape[-1] == self.cfg.head_dim and dtype in (torch.float32, torch.bfloat16))

    def _weights_fuse_at(self, layer: int, lw: LayerWeights, T: int, dtype: torch.dtype) -> bool:
        """`fuses_attention`'s part that is the layer's weights' at T rows."""
        # the same every step: looked up once, by layer (not by the weights' object, which
        # RouterWeights.onto_huge_pages replaces by a copy of the same weights while it serves; a freed object's
        # id may come back)
        key = (layer, T, dtype)
        if (ok := self._weights_fuse.get(key)) is None:
            norms = [w for w in (lw.ln1, lw.q_norm, lw.k_norm) if w is not None]
            ok = self._weights_fuse[key] = (
                isinstance(lw.qkv, torch.Tensor) and isinstance(lw.o, torch.Tensor) and lw.qkv.dtype == dtype
                and lw.o.dtype == dtype and all(w.dtype in (dtype, torch.float32) for w in norms)
                and pick_rows(T, dtype, lw.qkv) is native.linear and pick_rows(T, dtype, lw.o) is native.linear)
            if T == 1 and not self._said:       # once: what a one-stream decode step runs (for the logs)
                self._said = True
                log.info("decode steps of one row: %s", "each attention block one native call" if ok else
                         "the attention blocks op by op (their weights' forms at one row are not all native)")
        return ok

    def block_args(self, layer: int, lw: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, step: StepInputs,
                   kv: KVCache) -> tuple:
        """kernels.native.attention_block's arguments after h, for this layer of a decode step."""
        slots, lens = (step.decode_window_slots, step.decode_window_lens) if layer in self.sliding else \
            (step.decode_slots, step.decode_lens)                            # [Bd, C], [Bd]
        parts = self.caches.block_parts.get(layer)
        if parts is None or parts[0] is not lw:          # made once for the layer's weights (they may be replaced)
            parts = (lw, self._block_head(lw), self._block_tail(lw))
            self.caches.keep(self._epoch, self.caches.block_parts, layer, parts)
        return (*parts[1], cos, sin, kv.k[layer], kv.v[layer], step.slots, slots, lens, *parts[2])

    def _block_head(self, lw: LayerWeights) -> tuple:
        """attention_block's weight arguments before rope's: ln1 .. full_qk_norm."""
        qk = self.cfg.qk_norm != "none"
        return (lw.ln1, lw.qkv, lw.qkv_bias, lw.q_norm if qk else None, lw.k_norm if qk else None,
                self.cfg.qk_norm == "full")

    def _block_tail(self, lw: LayerWeights) -> tuple:
        """attention_block's arguments after the KV slots: sinks .. eps."""
        cfg = self.cfg
        return lw.sinks, lw.o, lw.o_bias, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
