"""Fused MoE on CPU: token-expert pairs sorted by expert, one pair of GEMMs per expert that has work.

No Python work per token: the sort, the counts and the scatter-add are vectorised; the only Python loop
is over the experts that received tokens (at most E per call). Accumulation is float32 whatever the
weights' dtype. Threads: torch's intra-op pool, set by the process (`torch.set_num_threads`).

How each expert's GEMM is issued depends on its row count n, from measurements on this 2-core AVX2 machine
(`benchmarks/results/kernels.md`, weights streamed from memory):
- n = 1: a matrix-vector product (bf16 included: ≈30% faster than a 1-row GEMM);
- float32, n <= 4: `W @ x.T` keeps the weight-streaming GEMV shape (≈9.5 GB/s fp32) where `x @ W.T` packs W and
  halves the rate (≈4.3 GB/s);
- bfloat16 weights with n >= 8: without native bf16 arithmetic, bf16 GEMM is compute-bound (1.9 GB/s at
  n = 8, 0.5 GB/s at n = 32); upcasting the expert's weights to float32 first is 1.2-5x faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global ids -> local rows; -1 where the expert is not held here or the id is negative."""
    ids = topk_ids.long()
    if expert_map is None:
        return ids
    safe = ids.clamp(min=0)
    return torch.where(ids >= 0, expert_map.long()[safe], torch.full_like(ids, -1))


GEMV_MAX_ROWS = 4
BF16_UPCAST_MIN_ROWS = 8


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, K] @ w[N, K].T -> [n, N], issued in the fastest form for n and the dtype."""
    n = x.shape[0]
    if n == 1:
        return torch.mv(w, x[0])[None]
    if w.dtype == torch.bfloat16:
        return F.linear(x.float(), w.float()) if n >= BF16_UPCAST_MIN_ROWS else F.linear(x, w)
    if n <= GEMV_MAX_ROWS:
        return torch.mm(w, x.t()).t()
    return F.linear(x, w)


def fused_moe_cpu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                  topk_weights: torch.Tensor, expert_map: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    T, H = x.shape
    K = topk_ids.shape[1]
    I = w2.shape[2]
    acc = torch.zeros(T, H, dtype=torch.float32)                 # [T, H]
    flat = local_ids(topk_ids, expert_map).reshape(-1)           # [T*K]
    order = torch.argsort(flat, stable=True)                     # [T*K] pairs grouped by expert
    sorted_ids = flat[order]
    counts = torch.bincount(sorted_ids + 1, minlength=w13.shape[0] + 1).tolist()  # [1 + E]; slot 0 = dropped
    weights = topk_weights.reshape(-1).float()                   # [T*K]
    xc = x if x.dtype == w13.dtype else x.to(w13.dtype)
    start = counts[0]
    for e, n in enumerate(counts[1:]):
        if n == 0:
            continue
        pairs = order[start:start + n]                           # [n]
        rows = pairs // K                                        # [n] token of each pair
        start += n
        gate_up = _linear(xc[rows], w13[e])                      # [n, 2I]
        h = F.silu(gate_up[:, :I]) * gate_up[:, I:]              # [n, I]
        y = _linear(h, w2[e]).float()                            # [n, H]
        acc.index_add_(0, rows, y * weights[pairs, None])
    if out is None:
        return acc.to(x.dtype)
    return out.copy_(acc)
