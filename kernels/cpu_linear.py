"""x @ W.T on CPU, issued in the fastest form for the row count and dtype.

Measured on the 2-core AVX2 dev machine with weights streamed from memory (`benchmarks/results/kernels.md`):
- n = 1: a matrix-vector product (≈11 GB/s bf16, ≈10 GB/s fp32); a 1-row GEMM is up to 30% slower;
- float32, n <= 4: `W @ x.T` keeps the weight-streaming GEMV shape (≈9.5 GB/s) where `x @ W.T` packs W
  first and halves the rate (≈4.3 GB/s); above 4 rows the gain was not repeatable, so F.linear;
- bfloat16 on a CPU without native bf16 arithmetic: the GEMM is compute-bound from n ≈ 4 (1.9 GB/s at
  n = 8, 0.5 GB/s at n = 32); upcasting W to float32 per call is faster from n = 8 (fused MoE at T=128:
  150-200 ms with the upcast, 240-600 ms without). Callers that batch every step over the same weights
  should hold float32 weights instead (the router does, see router_service/build.py `compute_dtype`).
CUDA tensors go straight to F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GEMV_MAX_ROWS = 4
BF16_UPCAST_MIN_ROWS = 8


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, Din], w [Dout, Din] (+ bias [Dout]) -> [n, Dout] in x's dtype."""
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


def cpu_has_fast_bf16() -> bool:
    """Native bf16 arithmetic (AVX512-BF16 or AMX); without it bf16 GEMMs are emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
