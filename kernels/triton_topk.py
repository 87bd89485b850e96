"""Launcher of the Triton top-k softmax routing kernel."""

from __future__ import annotations

import torch
import triton

from kernels.triton_topk_kernel import topk_softmax_kernel


def topk_route_triton(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"topk_route_triton: logits must be [T, E] with unit stride, got {list(logits.shape)}")
    T, E = logits.shape
    weights = torch.empty(T, k, dtype=torch.float32, device=logits.device)   # [T, k]
    ids = torch.empty(T, k, dtype=torch.int64, device=logits.device)         # [T, k]
    if T:
        topk_softmax_kernel[(T,)](logits, weights, ids, E, logits.stride(0),
                                  TOP_K=k, TOPK_POW2=triton.next_power_of_2(k), BLOCK_E=triton.next_power_of_2(E),
                                  RENORMALIZE=renormalize)
    return weights, ids
