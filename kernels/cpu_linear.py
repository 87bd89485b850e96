"""x @ W.T (+ bias), issued in the form measured fastest on this machine for W's shape and the row count.

The forms and their measurement live in `kernels/cpu_forms.py`; before a measurement is installed (or for
a shape that was not measured), the defaults are the forms measured on the 2-core AVX2 dev machine:
- n = 1: a matrix-vector product (≈11 GB/s bf16, ≈10 GB/s fp32; a 1-row GEMM is up to 30% slower);
- float32, n <= 4: `W @ x.T` keeps the weight-streaming GEMV shape (≈9.5 GB/s) where `x @ W.T` packs W
  first and halves the rate (≈4.3 GB/s);
- bfloat16 from n = 8 without native bf16 arithmetic: upcasting W to float32 per call beats the emulated
  bf16 GEMM (fused MoE at T=128: 150-200 ms with the upcast, 240-600 ms without).
CUDA tensors go straight to F.linear.

Shapes: n rows, Din input features, Dout output features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu_forms import Weight, pick
from kernels.formats.int8 import Int8Weight


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, Din], w [Dout, Din] float or int8 (+ bias [Dout]) -> [n, Dout] in x's dtype. An int8 weight with an
    `act_dtype` multiplies x in that dtype (the one the user chose: a router that computes its float layers in
    float32 on a CPU without bf16 arithmetic still gives its int8 layers bf16 activations, which the int8 kernel
    runs fastest)."""
    if x.dim() != 2 or (x.is_cuda and not isinstance(w, Int8Weight)):
        return F.linear(x, w, bias)
    if isinstance(w, Int8Weight) and w.act_dtype is not None and x.dtype != w.act_dtype:
        xa = x.to(w.act_dtype)                                              # [n, Din]
        y = pick(xa, w)(xa, w).to(x.dtype)                                  # [n, Dout]
    else:
        y = pick(x, w)(x, w)                                                # [n, Dout]
    return y if bias is None else y + bias


def cpu_has_fast_bf16() -> bool:
    """Native bf16 arithmetic (AVX512-BF16 or AMX); without it bf16 GEMMs are emulated and slow."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
