"""Gate scores -> top-k experts: softmax over all experts in float32, top-k, optional renormalisation.

Shapes: T tokens, E experts, k experts per token.
"""

from __future__ import annotations

import torch


def topk_route_torch(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)    # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)                   # [T, k], [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
