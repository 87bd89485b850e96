"""x @ W.T on CPU, issued in the fastest form for the row count and dtype.

Measured on the 2-core AVX2 dev machine with weights streamed from memory (`benchmarks/results/kernels.md`):
- n = 1: a matrix-vector product (≈11 GB/s bf16, ≈10 GB/s fp32); a 1-row GEMM is up to 30% slower;
- float32, n <= 4: `W @ x.T` keeps the weight-streaming GEMV shape (≈9.5 GB/s) where `x @ W.T` packs W
  and halves the rate (≈4.3 GB/s);
- bfloat16, n >= 8: without native bf16 arithmetic the bf16 GEMM is compute-bound (1.9 GB/s at n = 8,
  0.5 GB/s at n = 32); upcasting W to float32 first is 1.2-5x faster.
CUDA tensors go straight to F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GEMV_MAX_ROWS = 4
BF16_UPCAST_MIN_ROWS = 8


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, K], w [N, K] (+ bias [N]) -> [n, N] in x's dtype."""
    n = x.shape[0]
    if x.is_cuda or x.dim() != 2:
        y = F.linear(x, w, bias)
    elif n == 1:
        y = torch.mv(w, x[0])[None]
        if bias is not None:
            y = y + bias
    elif w.dtype == torch.bfloat16 and n >= BF16_UPCAST_MIN_ROWS:
        y = F.linear(x.float(), w.float(), None if bias is None else bias.float()).to(x.dtype)
    elif w.dtype == torch.float32 and n <= GEMV_MAX_ROWS:
        y = torch.mm(w, x.t()).t()
        if bias is not None:
            y = y + bias
    else:
        y = F.linear(x, w, bias)
    return y
