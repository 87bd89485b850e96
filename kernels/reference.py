"""Plain float64 references for the kernels: obviously correct, slow, used by tests only.

Shapes: T tokens, H hidden size, E experts, I expert width, K experts per token (top-k).
"""

from __future__ import annotations

import torch

from kernels.activation import SILU, GatedAct


def fused_moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                        topk_weights: torch.Tensor, expert_map: torch.Tensor | None = None, act: GatedAct = SILU,
                        b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k w_k · (w2[e_k] @ act(w13[e_k][:I] @ x + b13[:I], w13[e_k][I:] @ x + b13[I:]) + b2), in float64,
    token by token; the clamped activation written out from GPT-OSS's model card."""
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
            if b13 is not None:
                gu = gu + b13[e].double()
            gate, up = gu[:I], gu[I:]
            if act.limit is not None:
                gate = torch.minimum(gate, torch.tensor(act.limit, dtype=torch.float64))
                up = torch.maximum(torch.minimum(up, torch.tensor(act.limit, dtype=torch.float64)),
                                   torch.tensor(-act.limit, dtype=torch.float64))
            h = gate / (1 + torch.exp(-act.alpha * gate)) * (up + act.up_offset)   # [I]
            y = w2d[e] @ h                                         # [H]
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(topk_weights[t, k]) * y
    return out


def topk_route_reference(logits: torch.Tensor, k: int, renormalize: bool, scoring: str = "softmax",
                         bias: torch.Tensor | None = None, num_groups: int = 1, topk_groups: int = 1,
                         group_score: str = "max", scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token in float64, written as the model cards describe the routing (see kernels/routing.py)."""
    T, E = logits.shape
    ws, ids = [], []
    for t in range(T):
        x = logits[t].double()                                                # [E]
        if scoring == "topk_softmax":
            top = sorted(range(E), key=lambda e: (-float(x[e]), e))[:k]
            w = torch.softmax(x[top], dim=0)
            ws.append(w * scaling)
            ids.append(torch.tensor(top))
            continue
        p = torch.softmax(x, dim=0) if scoring == "softmax" else 1 / (1 + torch.exp(-x))     # [E]
        c = p + (bias.double() if bias is not None else 0)
        allowed = set(range(E))
        if num_groups > 1:
            size = E // num_groups
            group = []
            for g in range(num_groups):
                vals = sorted((float(c[e]) for e in range(g * size, (g + 1) * size)), reverse=True)
                group.append(vals[0] if group_score == "max" else vals[0] + vals[1])
            best = sorted(range(num_groups), key=lambda g: (-group[g], g))[:topk_groups]
            allowed = {e for g in best for e in range(g * size, (g + 1) * size)}
        top = sorted(allowed, key=lambda e: (-float(c[e]), e))[:k]
        w = p[top]
        if renormalize:
            w = w / (w.sum() + 1e-20)
        ws.append(w * scaling)
        ids.append(torch.tensor(top))
    return torch.stack(ws), torch.stack(ids)
