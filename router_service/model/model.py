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

from collections.abc import Generator
from functools import partial

import torch
import torch.nn.functional as F

from colibri_common.config import ModelConfig
from colibri_common.file_watch import FileWatch, MappingChanged
from kernels import Routing, describe_backend, linear, native, route
from router_service.model.attention import attention
from router_service.model.fusion import Fusion
from router_service.model.kv_cache import KVCache
from router_service.model.layers import (
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
from router_service.moe.experts import Experts, ExpertsUnavailable, Handle, Unsummed


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
        self.fusion = Fusion(cfg, self.routing, self.sliding)     # what of a CPU decode step is one native call
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
                        pending[j] = self._advance(g, pending[j].replies(), results, j)
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
                 ) -> Generator[Handle, torch.Tensor | Unsummed, torch.Tensor]:
        cfg, rows = self.cfg, self.rows
        step = step.to(self.device)                                          # built on the host
        assert not self.sliding or step.window == cfg.sliding_window, "sliding layers need the window's masks"
        self.guard()
        h = self.w.embed.index_select(0, step.token_ids)                     # [T, H] (no OpenMP region)
        cos, sin = rows(lambda p: self.rope.cos_sin(p, self.dtype, step.max_position), step.positions)   # [T, R]
        guess: set[int] | None = None                                        # prefetch: this layer's prediction
        fusion = None if self.prefetch else self.fusion        # (the prefetch's guesses need the layer's h)
        plan = None if fusion is None else fusion.decode_plan(self.w.layers, h, cos, step, kv, experts,
                                                              self.batch_invariant)
        if plan is not None:                                                 # every layer one native call
            h = plan.run(h, cos, sin, step, routes if self.track_routing else None)
        carry: Unsummed | None = None      # the last MoE layer's replies, which the next layer's front sums
        for i in range(len(self.w.layers) if plan is None else 0):
            # read as the loop reaches it, after the caches' epoch: the huge pages' thread may replace a layer and
            # then forget what was kept of the old one, which must not be kept again
            lw = self.fusion.read_layer(self.w.layers, i)
            if fusion is not None and carry is None and (fused := fusion.whole_layer(
                    i, lw, h, cos, sin, step, kv, experts, self.batch_invariant)) is not None:
                h, ids = fused                                               # the layer in one native call
                if self.track_routing:
                    routes.append(ids)
                continue
            front = self.fusion.front(i, lw, h, cos, sin, step, kv, self.batch_invariant, carry)
            last, carry = carry, None
            if front is not None:                                            # attention and routing in one call
                h, r, weights, ids = front                                   # (and the last layer's sum)
            else:
                if last is not None:                                         # not summed by a front: here
                    h = h + last.sum()
                h = h + self._attention(i, lw, h, cos, sin, step, kv)
                if lw.gate is None:
                    h = h + rows(partial(self._dense_mlp, lw), h)
                    continue
                r, weights, ids = rows(partial(self._route, i, lw), h)      # [T, H], [T, K] f32, [T, K]  route
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
            if not isinstance(out, torch.Tensor):                            # the replies, unsummed
                if shared is None:
                    carry = out                                              # summed by the next front
                    continue
                out = out.sum()
            h = h + (out if shared is None else out + shared)
        if carry is not None:
            h = h + carry.sum()
        self.guard()
        return rows(lambda h: linear(rms_norm(h, self.w.norm, cfg.rms_norm_eps), self.w.lm_head),
                    h.index_select(0, step.sample_rows)).float()             # [B, V]

    def guard(self) -> None:
        """Just before a read of the weights used in place: MappingChanged where their file changed since it was
        mapped (a truncated file would fault the read, SIGBUS; an overwritten one would feed other bytes). An
        fstat a file: under a microsecond."""
        if self.mapped is not None and (why := self.mapped.stale()) is not None:
            raise MappingChanged(why)

    def routing_form(self) -> str:
        """For the start-up log: what routes the MoE layers' tokens (the native call where every MoE layer takes it,
        else the kernels' backend: torch's ops or Triton's)."""
        moe = [lw for lw in self.w.layers if lw.gate is not None]
        if moe and all(Fusion.routes_natively(lw, self.dtype, self.device) for lw in moe):
            return "native"
        return describe_backend(self.device)

    def _dense_mlp(self, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        return silu_mlp(rms_norm(h, lw.ln2, self.cfg.rms_norm_eps), lw.mlp_gate_up, lw.mlp_down)    # [T, H]

    def _route(self, layer: int, lw: LayerWeights, h: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The MoE block's input r [T, H] and its routing: weights [T, K] float32, ids [T, K]. On a CPU with the
        native decoder ops, one call (norm, the gate's native linear, routing) where the torch forms take ~10."""
        if self.fusion.native_route(layer, lw, h):
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
        if self.fusion.fuses_attention(layer, lw, h, cos, step, kv, self.batch_invariant):   # one native call
            return native.attention_block(h, *self.fusion.block_args(layer, lw, cos, sin, step, kv))   # [T, H]
        q, k, v = rows(lambda h, cos, sin: self._qkv(lw, h, cos, sin), h, cos, sin)
        out = attention(layer, q, k, v, step, kv, layer in self.sliding, lw.sinks, self.batch_invariant)
        return rows(lambda o: linear(o.reshape(o.shape[0], -1), lw.o, lw.o_bias), out)   # [T, H]

    def forget_weights(self) -> None:
        """Drop what the engine keeps of the layers' weights (decode plans, arguments, checks): they were replaced
        (RouterWeights.onto_huge_pages), and the old copies must go. Any thread; the next step makes them anew."""
        self.fusion.caches.forget()

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
