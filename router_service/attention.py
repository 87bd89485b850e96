"""Grouped-query attention over the paged KV cache, for every non-latent architecture: one SDPA call per decode
batch and per prefill, or, for a layer with attention sinks (GPT-OSS), the same sums written out with the
sink's logit in each softmax's denominator. A sliding layer reads its window's masks from the step.

Sinks: transformers appends each head's learned logit s_h as one more column of the scores, softmaxes, and
drops it, so the weights are exp(x_j) / (Σ exp(x_i) + exp(s_h)): a head may attend to nothing. Here the
scores are computed in float32 with GQA folded in (the query heads of one KV head as one batch of rows).

Shapes: T tokens, Hq / Hkv query / key-value heads, g = Hq / Hkv, D head dim, Bd decode sequences, C context
(padded for decode), n new tokens of one prefill.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from router_service.kv_cache import KVCache
from router_service.step_inputs import StepInputs


def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: StepInputs, kv: KVCache,
              sliding: bool, sinks: torch.Tensor | None) -> torch.Tensor:
    """q [T, Hq, D], this step's rotated k and v [T, Hkv, D] (written to the cache here) -> [T, Hq, D]."""
    kv.write(layer, step.slots, k, v)
    out = torch.empty_like(q)                                                # [T, Hq, D]
    nd = step.num_decode
    if nd:
        kd, vd = kv.gather(layer, step.decode_slots)                         # [Bd, C, Hkv, D]
        mask = step.decode_window_mask if sliding else step.decode_mask      # [Bd, 1, 1, C]
        out[:nd] = _attend(q[:nd, :, None, :], kd.transpose(1, 2), vd.transpose(1, 2), mask, sinks)[:, :, 0, :]
    for j, (row, n, ctx_slots, mask) in enumerate(step.prefills):
        kp, vp = kv.gather(layer, ctx_slots)                                 # [ctx, Hkv, D]
        if sliding:
            mask = step.prefill_window_masks[j]                              # [n, ctx]
        o = _attend(q[row:row + n].transpose(0, 1)[None], kp.transpose(0, 1)[None], vp.transpose(0, 1)[None],
                    mask, sinks)                                             # [1, Hq, n, D]
        out[row:row + n] = o[0].transpose(0, 1)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """q [B, Hq, n, D], k/v [B, Hkv, C, D], mask bool [B | 1, 1, n | 1, C] or None (causal) -> [B, Hq, n, D]."""
    if sinks is None:                                                        # 4-D: SDPA's fused CPU kernels
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    B, Hq, n, D = q.shape
    Hkv, C = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qg = q.reshape(B, Hkv, g * n, D).float()                                 # query head h = kv head h // g
    scores = (qg @ k.float().transpose(-1, -2)).view(B, Hkv, g, n, C) * D**-0.5     # [B, Hkv, g, n, C]
    if mask is None:
        mask = torch.ones(n, C, dtype=torch.bool, device=q.device).tril(C - n)
    if mask.dim() == 2:                                                      # [n, C] -> [1, 1, n, C]
        mask = mask[None, None]
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))           # [B | 1, 1, 1, n | 1, C]
    sink = sinks.float().view(1, Hkv, g, 1, 1).expand(B, Hkv, g, n, 1)      # [B, Hkv, g, n, 1]
    logits = torch.cat([scores, sink], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :C]   # the sink's share dropped
    out = probs.reshape(B, Hkv, g * n, C) @ v.float()                        # [B, Hkv, g n, D]
    return out.view(B, Hq, n, D).to(q.dtype)
