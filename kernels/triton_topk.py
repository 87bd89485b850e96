"""Launcher of the Triton routing kernel: checks shapes and dtypes, computes the grid (one program per token)."""

from __future__ import annotations

import torch
import triton

from kernels.routing import SCORINGS, Routing
from kernels.triton_topk_kernel import topk_route_kernel


def topk_route_triton(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"topk_route_triton: logits must be [T, E] with unit stride, got {list(logits.shape)}")
    T, E = logits.shape
    if bias is not None and (bias.shape != (E,) or bias.device != logits.device):
        raise ValueError(f"topk_route_triton: bias must be [E={E}] on {logits.device}, got {list(bias.shape)} on "
                         f"{bias.device}")
    k = routing.top_k
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)   # [T, k]
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)         # [T, k]
    if T:
        topk_route_kernel[(T,)](
            logits, bias.contiguous() if bias is not None else logits, weights, ids, E, E // routing.num_groups,
            logits.stride(0), float(routing.scaling), TOP_K=k, TOPK_POW2=triton.next_power_of_2(k),
            BLOCK_E=triton.next_power_of_2(E), SCORING=SCORINGS.index(routing.scoring), HAS_BIAS=bias is not None,
            NUM_GROUPS=routing.num_groups, TOPK_GROUPS=routing.topk_groups,
            GROUP_TOP2=routing.group_score == "top2", RENORMALIZE=routing.renormalize)
    return weights, ids
