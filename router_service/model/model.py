"""The decoder, once for every architecture: differences come from `ModelConfig`/`ArchSpec` as data.

forward(micro-batches) = for each micro-batch: embed → for each layer: attention (paged KV) → gate/top-k
→ experts (remote or local) → final norm → lm_head on the rows that sample.

Each micro-batch's forward is a generator that yields at every expert dispatch; `forward` advances them in
turn, so the router computes attention for one micro-batch while the workers compute experts for another
(ping-pong). With one micro-batch it is the plain sequential forward.

Two optional by-products for the expert tiers (issue 12), both off by default:
- `prefetch`: at each MoE layer the *next* MoE layer's gate is applied to this layer's hidden states
  (pre-gating); the predicted experts travel with this layer's dispatch, so the workers pack them ahead.
- `track_routing`: each micro-batch's top-k ids per MoE layer are kept (`last_routing`), so the engine knows
  each sequence's recent experts (routing-aware batching).

Shapes: T tokens in the micro-batch, B of them sampled, H hidden size, V vocabulary, E experts per layer,
K experts per token (top-k), Hq / Hkv query / key-value heads, D head dim, R of its dims that rotate, Bd decode
sequences, C context length (cached + new tokens), n new tokens of one prefill.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from functools import partial

import torch
import torch.nn.functional as F

from colibri_common.config import ModelConfig
from colibri_common.file_watch import FileWatch, MappingChanged
from kernels import Routing, backend_for, describe_backend, linear, native, pick_rows, route
from router_service.model.attention import attention
from router_service.model.decode_layers import DecodePlan, LayerCaches, make_plan
from router_service.model.kv_cache import KVCache
from router_service.model.layers import (
    NORM_TYPES,
    Rope,
    RowMap,
    apply_rope,
    apply_rope_interleaved,
    by_row,
    rms_norm,
    silu_mlp,
    whole,
)
from router_service.model.mla import mla_attention, mla_scale
from router_service.model.step_inputs import StepInputs
from router_service.model.weights import LayerWeights, RouterWeights
from router_service.moe.experts import Experts, ExpertsUnavailable, Handle

log = logging.getLogger("colibri.router")


def routing_of(cfg: ModelConfig) -> Routing:
    """How the model's MoE layers route (kernels/routing.py)."""
    return Routing(cfg.top_k, cfg.scoring, cfg.norm_topk_prob, cfg.num_groups, cfg.topk_groups, cfg.arch.group_score,
                   cfg.routed_scaling)


class RouterModel:
    def __init__(self, cfg: ModelConfig, weights: RouterWeights, dtype: torch.dtype,
                 device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.w = weights
        self.dtype = dtype
        self.device = device or torch.device("cpu")
        self.rope = Rope(cfg.rotary_dim, cfg.rope_theta, self.device, cfg.rope_scaling)
        self.routing = routing_of(cfg)
        self.mla_scale = mla_scale(cfg) if cfg.mla is not None else 0.0
        self.mla_rope = apply_rope_interleaved if cfg.mla is not None and cfg.mla.rope_interleave else apply_rope
        self.sliding = frozenset(cfg.sliding_layers)                      # layers that read the window's masks
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.overlaps = 0     # waits on one micro-batch's experts while another micro-batch's are still computing
        self.prefetch = False
        self.track_routing = False
        self.batch_invariant = False   # every row alone (`by_row`), attention per query: see `rows`
        self.fused_attention = True    # decode steps' attention blocks in one native call where they may (_fusable)
        self.fused_layers = True       # and whole MoE layers, where the experts are in this process (_whole_layer)
        self._said_fused = False
        self._weights_fuse: dict[tuple[int, int, torch.dtype], bool] = {}    # _fusable's weight checks, by row count
        self._caches = LayerCaches()    # plans, arguments and checks made once for the layers' weights
        self._step_fuse: tuple[StepInputs | None, bool] = (None, False)       # _fusable's step part, for its step
        self.mapped: FileWatch | None = None   # the files of the weights used in place (build.py), checked by guard
        self.last_routing: list[list[torch.Tensor]] = []      # per micro-batch: ids [T, K] per MoE layer
        self.predicted = self.predicted_right = 0            # prefetch: experts predicted, and then routed to
        moe = [i for i, lw in enumerate(weights.layers) if lw.gate is not None]
        self.next_moe = {a: b for a, b in zip(moe, moe[1:], strict=False)}   # MoE layer -> the next MoE layer
        self.moe_layers = moe                                                # the MoE layers, in order

    @torch.inference_mode()
    def forward(self, steps: list[StepInputs], kv: KVCache, experts: Experts) -> torch.Tensor:
        """Logits [B, V] float32 of every sampled row, micro-batches concatenated in order."""
        routes: list[list[torch.Tensor]] = [[] for _ in steps]
        gens = [self._forward(s, kv, experts, routes[j]) for j, s in enumerate(steps)]
        results: list[torch.Tensor | None] = [None] * len(gens)
        j = 0
        try:
            pending = []
            for j, g in enumerate(gens):
                pending.append(self._advance(g, None, results, j))
            while any(p is not None for p in pending):
                for j, g in enumerate(gens):
                    if pending[j] is not None:
                        others = [p for i, p in enumerate(pending) if i != j and p is not None]
                        self.overlaps += any(not p.done() for p in others)
                        pending[j] = self._advance(g, pending[j].result(), results, j)
        except ExpertsUnavailable as exc:
            exc.micro_batch = j               # whose token rows these are
            raise
        self.last_routing = routes if self.track_routing else []
        return results[0] if len(results) == 1 else torch.cat(results)  # type: ignore[arg-type]

    @property
    def rows(self) -> RowMap:
        """How the row-local parts of a step run: all rows at once, or, under batch invariance, one row at a time
        (each op then sees one token's shapes, so no kernel's blocking or vector tail depends on the batch)."""
        return by_row if self.batch_invariant else whole

    def _gate(self, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s routing of residual states h [T, H]: weights [T, K] float32, ids [T, K]."""
        lw = self.w.layers[layer]
        r = rms_norm(h, lw.ln2, self.cfg.rms_norm_eps)
        return route(self._scores(r, lw), self.routing, lw.gate_correction)

    @staticmethod
    def _scores(r: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        """Gate logits [T, E], in the gate's dtype (float32 where the architecture computes its gate so), plus the
        gate's bias where it has one (GPT-OSS)."""
        x = r if r.dtype == lw.gate.dtype else r.to(lw.gate.dtype)
        if lw.gate_bias is not None:                       # one rounding, as transformers' F.linear with a bias
            return F.linear(x, lw.gate, lw.gate_bias)
        return linear(x, lw.gate)

    @torch.inference_mode()
    def predict_experts(self, token_ids: list[int]) -> frozenset[int]:
        """A prompt's likely experts before it runs: every MoE layer's gate on the token embeddings (the part
        of the residual stream the layers add to), the top-k by summed weight per layer, as layer·E + e."""
        cfg = self.cfg
        self.guard()
        h = self.w.embed[torch.tensor(token_ids[-16:], device=self.device)]          # [n, H]
        out: set[int] = set()
        for i, lw in enumerate(self.w.layers):
            if lw.gate is None:
                continue
            weights, ids = self._gate(i, h)                                            # [n, K]
            mass = torch.zeros(cfg.num_experts, device=self.device).index_add_(0, ids.flatten(), weights.flatten())
            out.update(i * cfg.num_experts + e for e in mass.topk(cfg.top_k).indices.tolist())
        return frozenset(out)

    @staticmethod
    def _advance(gen: Generator[Handle, torch.Tensor, torch.Tensor], value: torch.Tensor | None,
                 results: list[torch.Tensor | None], j: int) -> Handle | None:
        try:
            return next(gen) if value is None else gen.send(value)
        except StopIteration as stop:
            results[j] = stop.value
            return None

    def _forward(self, step: StepInputs, kv: KVCache, experts: Experts, routes: list[torch.Tensor]
                 ) -> Generator[Handle, torch.Tensor, torch.Tensor]:
        cfg, rows = self.cfg, self.rows
        step = step.to(self.device)                                          # built on the host
        assert not self.sliding or step.window == cfg.sliding_window, "sliding layers need the window's masks"
        self.guard()
        h = self.w.embed.index_select(0, step.token_ids)                     # [T, H] (no OpenMP region)
        cos, sin = rows(lambda p: self.rope.cos_sin(p, self.dtype, step.max_position), step.positions)   # [T, R]
        guess: set[int] | None = None                                        # prefetch: this layer's prediction
        if (plan := self._decode_plan(h, cos, step, kv, experts)) is not None:   # every layer one native call
            h = plan.run(h, cos, sin, step, routes if self.track_routing else None)
        for i, lw in enumerate(self.w.layers if plan is None else ()):
            if (fused := self._whole_layer(i, lw, h, cos, sin, step, kv, experts)) is not None:
                h, ids = fused                                               # the layer in one native call
                if self.track_routing:
                    routes.append(ids)
                continue
            h = h + self._attention(i, lw, h, cos, sin, step, kv)
            if lw.gate is None:
                h = h + rows(partial(self._dense_mlp, lw), h)
                continue
            r, weights, ids = rows(partial(self._route, i, lw), h)          # [T, H], [T, K] f32, [T, K]  route
            if self.track_routing:
                routes.append(ids)
            ahead = None
            if self.prefetch:
                if guess is not None:                                        # how good was the last guess
                    self.predicted += len(guess)
                    self.predicted_right += len(guess & set(ids.unique().tolist()))
                nxt = self.next_moe.get(i)
                guess = None if nxt is None else set(self._gate(nxt, h)[1].unique().tolist())
                ahead = None if nxt is None else (nxt, sorted(guess))
            handle = experts.submit(i, r, ids, weights, ahead)               # partition → transport
            shared = None
            if lw.mlp_gate_up is not None:                     # shared experts, computed while the experts run
                shared = rows(partial(self._shared, lw), r)                                       # [T, H]
            out = yield handle                                               # combine  [T, H]
            h = h + (out if shared is None else out + shared)
        self.guard()
        return rows(lambda h: linear(rms_norm(h, self.w.norm, cfg.rms_norm_eps), self.w.lm_head),
                    h.index_select(0, step.sample_rows)).float()             # [B, V]

    def guard(self) -> None:
        """Just before a read of the weights used in place: MappingChanged where their file changed since it was
        mapped (a truncated file would fault the read, SIGBUS; an overwritten one would feed other bytes). An
        fstat a file: under a microsecond."""
        if self.mapped is not None and (why := self.mapped.stale()) is not None:
            raise MappingChanged(why)

    @staticmethod
    def _routes_natively(lw: LayerWeights, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether a MoE layer's front (norm, gate, routing) is the one native call (`_route`): on a CPU, not where
        the Triton backend runs the GPU's path (the interpreter, in tests), plain gate weights of the step's dtype."""
        return (device.type == "cpu" and backend_for(device) != "triton" and native.decoder_ops()
                and lw.gate_bias is None and isinstance(lw.gate, torch.Tensor) and lw.gate.dtype == dtype
                and (dtype, lw.ln2.dtype) in NORM_TYPES)

    def routing_form(self) -> str:
        """For the start-up log: what routes the MoE layers' tokens (the native call where every MoE layer takes it,
        else the kernels' backend: torch's ops or Triton's)."""
        moe = [lw for lw in self.w.layers if lw.gate is not None]
        if moe and all(self._routes_natively(lw, self.dtype, self.device) for lw in moe):
            return "native"
        return describe_backend(self.device)

    def _dense_mlp(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        return silu_mlp(rms_norm(h, lw.ln2, self.cfg.rms_norm_eps), lw.mlp_gate_up, lw.mlp_down)    # [T, H]

    def _route(self, layer: int, lw: LayerWeights, h: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MoE block's input r [T, H] and its routing: weights [T, K] float32, ids [T, K]. On a CPU with the
        native decoder ops, one call (norm, the gate's native linear, routing) where the torch forms take ~10."""
        known, ops = self._caches.routes.get(layer), native.decoder_ops()     # (refused: the torch forms at once)
        if known is None or known[0] is not lw or known[1] != h.dtype or known[3] != ops:   # once for the weights
            epoch = self._caches.epoch
            known = (lw, h.dtype, self._routes_natively(lw, h.dtype, h.device), ops)
            self._caches.keep(epoch, self._caches.routes, layer, known)
        if known[2]:
            return native.moe_route(h, lw.ln2, lw.gate, self.cfg.rms_norm_eps, self.routing, lw.gate_correction)
        r = rms_norm(h, lw.ln2, self.cfg.rms_norm_eps)
        weights, ids = route(self._scores(r, lw), self.routing, lw.gate_correction)
        return r, weights, ids

    @staticmethod
    def _shared(lw: LayerWeights, r: torch.Tensor) -> torch.Tensor:
        shared = silu_mlp(r, lw.mlp_gate_up, lw.mlp_down)                                         # [T, H]
        if lw.shared_gate is not None:                                     # Qwen2-MoE's sigmoid gate
            shared = torch.sigmoid(linear(r, lw.shared_gate)) * shared
        return shared

    def _attention(self, layer: int, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, step: StepInputs, kv: KVCache) -> torch.Tensor:
        """The attention block's output [T, H] for residual states h [T, H] (its norm included)."""
        cfg, rows = self.cfg, self.rows
        if lw.mla is not None:
            x = rows(lambda h: rms_norm(h, lw.ln1, cfg.rms_norm_eps), h)
            out = mla_attention(cfg, lw.mla, layer, x, self.mla_rope, cos, sin, step, kv, self.mla_scale, rows,
                                self.batch_invariant)
            return rows(lambda o: linear(o, lw.o, lw.o_bias), out)          # [T, H]
        if self._fusable(layer, lw, h, cos, step, kv):                    # decode rows only: one native call
            return native.attention_block(h, *self._block_args(layer, lw, cos, sin, step, kv))   # [T, H]
        q, k, v = rows(lambda h, cos, sin: self._qkv(lw, h, cos, sin), h, cos, sin)
        out = attention(layer, q, k, v, step, kv, layer in self.sliding, lw.sinks, self.batch_invariant)
        return rows(lambda o: linear(o.reshape(o.shape[0], -1), lw.o, lw.o_bias), out)   # [T, H]

    def _block_args(self, layer: int, lw: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, step: StepInputs,
                    kv: KVCache) -> tuple:
        """kernels.native.attention_block's arguments after h, for this layer of a decode step."""
        slots, lens = (step.decode_window_slots, step.decode_window_lens) if layer in self.sliding else \
            (step.decode_slots, step.decode_lens)                            # [Bd, C], [Bd]
        parts = self._caches.block_parts.get(layer)
        if parts is None or parts[0] is not lw:          # made once for the layer's weights (they may be replaced)
            epoch = self._caches.epoch
            parts = (lw, self._block_head(lw), self._block_tail(lw))
            self._caches.keep(epoch, self._caches.block_parts, layer, parts)
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

    def _decode_plan(self, h: torch.Tensor, cos: torch.Tensor, step: StepInputs, kv: KVCache, experts: Experts
                     ) -> DecodePlan | None:
        """Every layer of this decode step as a loop of native decoder_layer calls (decode_layers.py), where each
        layer would take `_whole_layer`'s one call; None where some layer runs otherwise. Made once per (rows,
        dtype) and kept while the layers' weights, the experts' plan and the KV cache are the same objects."""
        if not self.fused_layers or self.prefetch or not self._fusable_step(h, cos, step, kv):
            return None
        moes = experts.native_layers(h)                  # checks the experts' mapped files, as native_layer does
        if moes is None:
            return None
        key, layers = (h.shape[0], h.dtype), tuple(self.w.layers)      # one snapshot: another thread may replace
        plan = self._caches.plans.get(key)                              # a layer meanwhile (huge pages)
        if plan is None or not plan.fits(layers, moes, (kv.k, kv.v)):
            epoch = self._caches.epoch
            plan = make_plan(layers, moes, kv, self.sliding, partial(self._layer_call, h))
            self._caches.keep_plan(epoch, key, plan)
        return plan if plan.calls is not None else None

    def _layer_call(self, h: torch.Tensor, layer: int, lw: LayerWeights, moe: native.LayerExperts
                    ) -> native.DecoderLayerCall | None:
        """A decode plan's call of this layer at h's rows and dtype, or None where it does not fuse."""
        if (lw.gate is None or lw.mla is not None or lw.mlp_gate_up is not None
                or not self._fusable_weights(layer, lw, h.shape[0], h.dtype)
                or not self._routes_natively(lw, h.dtype, h.device)):
            return None
        return native.DecoderLayerCall(self._block_head(lw), self._block_tail(lw), lw.ln2, lw.gate, self.routing,
                                       lw.gate_correction, moe)

    def forget_weights(self) -> None:
        """Drop what the engine keeps of the layers' weights (decode plans, arguments, checks): they were replaced
        (RouterWeights.onto_huge_pages), and the old copies must go. Any thread; the next step makes them anew."""
        self._caches.forget()

    def _whole_layer(self, layer: int, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     step: StepInputs, kv: KVCache, experts: Experts) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A MoE layer of a decode step in one native call (kernels.native.decoder_layer: the attention block, the
        routing and the experts, with the bits of the three calls), where the experts are in this process on the
        native expert FFN (`experts.native_layer`): (h after the layer [T, H], the routed ids [T, K]); None where the
        layer runs call by call (prefills, shared experts, the prefetch's guesses, latent attention, experts
        elsewhere)."""
        if (not self.fused_layers or lw.gate is None or lw.mla is not None or lw.mlp_gate_up is not None
                or self.prefetch):
            return None
        moe = experts.native_layer(layer, h)      # first: None at once for workers, so the fleet's router does not
        if (moe is None or not self._fusable(layer, lw, h, cos, step, kv)   # make the checks below twice a layer
                or not self._routes_natively(lw, h.dtype, h.device)):
            return None
        return native.decoder_layer(h, self._block_args(layer, lw, cos, sin, step, kv), lw.ln2, lw.gate,
                                    self.routing, lw.gate_correction, moe)

    def _fusable(self, layer: int, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, step: StepInputs,
                 kv: KVCache) -> bool:
        """Whether this layer's attention block may run as one native call (kernels.native.attention_block, the
        bits of the op-by-op path below): a CPU step of decode rows only, not the GPU's path (the Triton backend,
        which the interpreter runs on a CPU in tests), no batch-invariant mode, plain float
        weights whose linear form here is the native one, and no clipped qkv."""
        if self._step_fuse[0] is not step:              # once a step (a layer's Python runs on cold caches)
            self._step_fuse = (step, self._fusable_step(h, cos, step, kv))
        return self._step_fuse[1] and self._fusable_weights(layer, lw, h.shape[0], h.dtype)

    def _fusable_step(self, h: torch.Tensor, cos: torch.Tensor, step: StepInputs, kv: KVCache) -> bool:
        """`_fusable`'s part that is the step's, the same for every layer."""
        T, dtype = h.shape[0], h.dtype
        return (self.fused_attention and not self.batch_invariant and step.num_decode == T and T > 0
                and not step.prefills and h.device.type == "cpu" and backend_for(h.device) != "triton"
                and native.decoder_ops()
                and self.cfg.clip_qkv is None and cos.dtype == dtype and kv.k.dtype == dtype
                and kv.v.shape[-1] == self.cfg.head_dim and dtype in (torch.float32, torch.bfloat16))

    def _fusable_weights(self, layer: int, lw: LayerWeights, T: int, dtype: torch.dtype) -> bool:
        """`_fusable`'s part that is the layer's weights' at T rows."""
        # the weights' part, the same every step: looked up once, by layer (not by the weights' object, which
        # RouterWeights.onto_huge_pages replaces by a copy of the same weights while it serves; a freed object's
        # id may come back)
        key = (layer, T, dtype)
        if (ok := self._weights_fuse.get(key)) is None:
            norms = [w for w in (lw.ln1, lw.q_norm, lw.k_norm) if w is not None]
            ok = self._weights_fuse[key] = (
                isinstance(lw.qkv, torch.Tensor) and isinstance(lw.o, torch.Tensor) and lw.qkv.dtype == dtype
                and lw.o.dtype == dtype and all(w.dtype in (dtype, torch.float32) for w in norms)
                and pick_rows(T, dtype, lw.qkv) is native.linear and pick_rows(T, dtype, lw.o) is native.linear)
            if T == 1 and not self._said_fused:       # once: what a one-stream decode step runs (for the logs)
                self._said_fused = True
                log.info("decode steps of one row: %s", "each attention block one native call" if ok else
                         "the attention blocks op by op (their weights' forms at one row are not all native)")
        return ok

    def _qkv(self, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rotated queries [T, Hq, D] and keys, and the values [T, Hkv, D] of residual states h [T, H]."""
        cfg = self.cfg
        T, D = h.shape[0], cfg.head_dim
        qkv = linear(rms_norm(h, lw.ln1, cfg.rms_norm_eps), lw.qkv, lw.qkv_bias)  # [T, (Hq + 2Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if cfg.qk_norm == "full":
            q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.reshape(T, cfg.num_heads, D)                                   # [T, Hq, D]
        k = k.reshape(T, cfg.num_kv_heads, D)                                # [T, Hkv, D]
        v = v.reshape(T, cfg.num_kv_heads, D)
        if cfg.qk_norm == "head":
            q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v
