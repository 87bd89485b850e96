"""x @ W.T on CPU, issued in the fastest form for the row count and dtype.

Measured on the 2-core AVX2 dev machine with weights streamed from memory (`benchmarks/results/kernels.md`):
- n = 1: a matrix-vector product (≈11 GB/s bf16, ≈10 GB/s fp32); a 1-row GEMM is up to 30% slower;
- float32, n <= 16: `W @ x.T` keeps the weight-streaming shape (≈9.5 GB/s at n <= 4, ≈6 GB/s at n = 8-16)
  where `x @ W.T` packs W first (≈4.3 GB/s at n = 4, ≈2.4 GB/s at n = 8);
- bfloat16 on a CPU without native bf16 arithmetic: the GEMM is compute-bound from n ≈ 4 (1.9 GB/s at
  n = 8); upcasting W per call is no cure (the bf16 → fp32 copy of a 1024 x 1024 weight took 6 ms in a
  profile), so callers that batch should hold float32 weights instead (the router does, see server.py).
CUDA tensors go straight to F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GEMV_MAX_ROWS = 16


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, K], w [N, K] (+ bias [N]) -> [n, N] in x's dtype."""
    n = x.shape[0]
    if x.is_cuda or x.dim() != 2:
        y = F.linear(x, w, bias)
    elif n == 1:
        y = torch.mv(w, x[0])[None]
        if bias is not None:
            y = y + bias
    elif w.dtype == torch.float32 and n <= GEMV_MAX_ROWS:
        y = torch.mm(w, x.t()).t()
        if bias is not None:
            y = y + bias
    else:
        y = F.linear(x, w, bias)
    return y


def cpu_has_fast_bf16() -> bool:
    """Native bf16 arithmetic (AVX512-BF16 or AMX); without it bf16 GEMMs are emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
