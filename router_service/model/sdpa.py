"""torch's scaled_dot_product_attention as the router calls it, on any device.

On a GPU two of torch's own choices cost more than the attention (docs/performance.md#gpu):
- its cuDNN backend builds a cuDNN graph for every new sequence length, and a decode step's lengths are new every
  step (measured on an H200 with torch 2.11: 6.2 ms of host time a call, 55% of a bench-model decode step). Our
  calls exclude it for their own duration (torch's backend flags are the process's; `sdpa_kernel` sets and
  restores them), so a process that imports Colibri keeps its own choice;
- with an explicit mask, grouped heads (`enable_gqa`) leave it only the math backend, which repeats the keys and
  values to the query heads and also materialises the [B, Hq, n, C] scores in float32. Here the keys and values
  are repeated first (the same copy), so the memory-efficient kernel can take the call without the scores.
On a CPU the call is torch's as written (its fused CPU kernels take grouped heads and masks).

Shapes: q [B, Hq, n, D], k / v [B, Hkv, C, D(v)], mask broadcastable to [B, Hq, n, C].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

GPU_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def repeat_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [B, Hkv, C, D] -> [B, Hq, C, D]: query head h reads key-value head h // (Hq / Hkv), as enable_gqa."""
    groups = q.shape[-3] // k.shape[-3]
    return k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """F.scaled_dot_product_attention's arguments and result ([B, Hq, n, Dv])."""
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    if enable_gqa and attn_mask is not None and k.shape[-3] != q.shape[-3]:
        k, v = repeat_groups(q, k, v)                                        # [B, Hq, C, D]
        enable_gqa = False
    with sdpa_kernel(GPU_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
