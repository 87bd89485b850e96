"""Fused MoE on CPU: token-expert pairs sorted by expert, one pair of GEMMs per expert that has work.

No Python work per token: the sort, the counts and the scatter-add are vectorised; the only Python loop
is over the experts that received tokens (at most E per call). Accumulation is float32 whatever the
weights' dtype. Threads: torch's intra-op pool, set by the process (`torch.set_num_threads`).
Each expert's GEMMs go through `kernels.cpu_linear.linear`, which picks the form per row count and dtype.

Shapes: T tokens, H hidden size, E local experts, I expert width, K experts per token (top-k), P
token-expert pairs computed here, n pairs of one expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_linear import linear
from kernels.quant import Int8Weight


def local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global ids -> local rows; -1 where the expert is not held here or the id is negative."""
    ids = topk_ids.long()
    if expert_map is None:
        return ids
    safe = ids.clamp(min=0)
    return torch.where(ids >= 0, expert_map.long()[safe], torch.full_like(ids, -1))


def fused_moe_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, expert_map: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    T, H = x.shape
    K = topk_ids.shape[1]
    I = w2.shape[2]
    flat = local_ids(topk_ids, expert_map).reshape(-1)           # [T*K]
    order = torch.argsort(flat, stable=True)                     # [T*K] pairs grouped by expert, dropped first
    counts = torch.bincount(flat + 1, minlength=w13.shape[0] + 1).tolist()  # [1 + E]; slot 0 = dropped
    order = order[counts[0]:]                                    # [P] the pairs computed here
    rows = order // K                                            # [P] token of each pair
    same = x.dtype == w13.dtype or isinstance(w13, Int8Weight)   # int8 weights take x's dtype as it is
    xs = (x if same else x.to(w13.dtype))[rows]                  # [P, H] one gather for all experts
    ys = torch.empty(order.numel(), H, dtype=torch.float32)      # [P, H]
    start = 0
    for e, n in enumerate(counts[1:]):
        if n == 0:
            continue
        gate_up = linear(xs[start:start + n], w13[e])           # [n, 2I]
        h = F.silu(gate_up[:, :I]) * gate_up[:, I:]              # [n, I]
        ys[start:start + n] = linear(h, w2[e])                  # [n, H]
        start += n
    ys *= topk_weights.reshape(-1)[order].float()[:, None]       # routed weight per pair
    acc = torch.zeros(T, H, dtype=torch.float32).index_add_(0, rows, ys)  # [T, H] sum over k
    if out is None:
        return acc.to(x.dtype)
    return out.copy_(acc)
