"""The decoder, once for every architecture: differences come from `ModelConfig`/`ArchSpec` as data.

forward(step) = embed → for each layer: attention (paged KV) → gate/top-k → experts (remote or local)
→ final norm → lm_head on the rows that sample.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from colibri_common.config import ModelConfig
from kernels import topk_route
from router_service.kv_cache import KVCache
from router_service.layers import Rope, apply_rope, rms_norm, silu_mlp
from router_service.step_inputs import StepInputs
from router_service.weights import LayerWeights, RouterWeights


class Experts(Protocol):
    """route → dispatch → experts → combine for one MoE layer: Σ_k w_k · FFN_{e_k}(x) per token."""

    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor: ...


class RouterModel:
    def __init__(self, cfg: ModelConfig, weights: RouterWeights, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.w = weights
        self.dtype = dtype
        self.rope = Rope(cfg.head_dim, cfg.rope_theta)
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim

    @torch.inference_mode()
    def forward(self, step: StepInputs, kv: KVCache, experts: Experts) -> torch.Tensor:
        h = self.w.embed[step.token_ids]                                     # [T, H]
        cos, sin = self.rope.cos_sin(step.positions, self.dtype)             # [T, D]
        for i, lw in enumerate(self.w.layers):
            r = rms_norm(h, lw.ln1, self.cfg.rms_norm_eps)
            h = h + self._attention(i, lw, r, cos, sin, step, kv)
            r = rms_norm(h, lw.ln2, self.cfg.rms_norm_eps)
            h = h + self._mlp(i, lw, r, experts)
        last = rms_norm(h[step.sample_rows], self.w.norm, self.cfg.rms_norm_eps)  # [B, H]
        return F.linear(last, self.w.lm_head).float()                        # [B, V]

    def _attention(self, layer: int, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, step: StepInputs, kv: KVCache) -> torch.Tensor:
        cfg = self.cfg
        T, D = x.shape[0], cfg.head_dim
        qkv = F.linear(x, lw.qkv, lw.qkv_bias)                              # [T, (Hq + 2Hkv) D]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if cfg.arch.qk_norm == "full":
            q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.reshape(T, cfg.num_heads, D)                                   # [T, Hq, D]
        k = k.reshape(T, cfg.num_kv_heads, D)                                # [T, Hkv, D]
        v = v.reshape(T, cfg.num_kv_heads, D)
        if cfg.arch.qk_norm == "head":
            q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv.write(layer, step.slots, k, v)
        out = torch.empty_like(q)                                            # [T, Hq, D]
        nd = step.num_decode
        if nd:
            kd, vd = kv.gather(layer, step.decode_slots)                     # [Bd, L, Hkv, D]
            o = F.scaled_dot_product_attention(
                q[:nd, :, None, :], kd.transpose(1, 2), vd.transpose(1, 2),  # [Bd, Hq, 1, D], [Bd, Hkv, L, D]
                attn_mask=step.decode_mask, enable_gqa=True)
            out[:nd] = o[:, :, 0, :]
        for row, n, ctx_slots, mask in step.prefills:
            kp, vp = kv.gather(layer, ctx_slots)                             # [ctx, Hkv, D]
            o = F.scaled_dot_product_attention(
                q[row:row + n].transpose(0, 1), kp.transpose(0, 1), vp.transpose(0, 1),  # [Hq, n, D] ...
                attn_mask=mask, is_causal=mask is None, enable_gqa=True)     # [Hq, n, D]
            out[row:row + n] = o.transpose(0, 1)
        return F.linear(out.reshape(T, -1), lw.o, lw.o_bias)                 # [T, H]

    def _mlp(self, layer: int, lw: LayerWeights, x: torch.Tensor, experts: Experts) -> torch.Tensor:
        if lw.gate is None:
            return silu_mlp(x, lw.mlp_gate_up, lw.mlp_down)
        logits = F.linear(x, lw.gate)                                        # [T, E]
        weights, ids = topk_route(logits, self.cfg.top_k, self.cfg.norm_topk_prob)  # [T, K] f32, [T, K]
        out = experts.forward(layer, x, ids, weights)                        # [T, H]
        if lw.shared_gate is not None:
            shared = silu_mlp(x, lw.mlp_gate_up, lw.mlp_down)                # [T, H]
            out = out + torch.sigmoid(F.linear(x, lw.shared_gate)) * shared
        return out
