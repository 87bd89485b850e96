"""Plain float64 references for the kernels: obviously correct, slow, used by tests only.

Shapes: T tokens, H hidden size, E experts, I expert width, K experts per token (top-k).
"""

from __future__ import annotations

import torch


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w_k · w2[e_k] @ (silu(w13[e_k][:I] @ x) * (w13[e_k][I:] @ x)), in float64, token by token."""
    T, H = x.shape
    I = w2.shape[2]
    out = torch.zeros(T, H, dtype=torch.float64)
    xd, w13d, w2d = x.double(), w13.double(), w2.double()
    for t in range(T):
        for k in range(topk_ids.shape[1]):
            e = int(topk_ids[t, k])
            if e < 0:
                continue
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            gu = w13d[e] @ xd[t]                                   # [2I]
            h = torch.nn.functional.silu(gu[:I]) * gu[I:]          # [I]
            out[t] += float(topk_weights[t, k]) * (w2d[e] @ h)     # [H]
    return out


def topk_route_reference(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.double(), dim=-1)                 # [T, E]
    w, ids = torch.topk(probs, k, dim=-1)                          # [T, k]
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids
