"""Launcher of the Triton fused MoE: checks shapes/dtypes/contiguity, aligns blocks, picks the grid.

Shapes: T tokens, H hidden size, E local experts, I expert width, top_k experts per token.
"""

from __future__ import annotations

import os

import torch
import triton

from kernels.activation import SILU, GatedAct
from kernels.cpu_moe import local_ids
from kernels.formats.fp8 import Fp8Weight
from kernels.formats.mxfp4 import BLOCK as MXFP4_BLOCK
from kernels.formats.mxfp4 import Mxfp4Weight
from kernels.graph_safe import graph_safe_active
from kernels.launch_config import LaunchConfig, get_config
from kernels.moe_align import Alignment, moe_align_block_size, moe_align_on_device
from kernels.triton_moe_kernel import down_weighted_kernel, gate_up_act_kernel

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
Quantized = (Fp8Weight, Mxfp4Weight)


def _device_name(x: torch.Tensor) -> str:
    return torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"


def _check(x: torch.Tensor, w13: torch.Tensor | Fp8Weight | Mxfp4Weight,
           w2: torch.Tensor | Fp8Weight | Mxfp4Weight) -> None:
    if isinstance(w13, Quantized) or isinstance(w2, Quantized):
        if type(w13) is not type(w2):
            raise TypeError("fused_moe_triton: w13 and w2 must both be FP8, both MXFP4, or neither")
        if x.dtype not in _DTYPES:
            raise TypeError(f"fused_moe_triton: x has dtype {x.dtype}; use float32, float16 or bfloat16")
        for name, w in (("w13", w13), ("w2", w2)):
            for t in (getattr(w, "values", None), getattr(w, "blocks", None), w.scales):
                if t is not None and not t.is_contiguous():
                    raise ValueError(f"fused_moe_triton: {name} must be contiguous")
                if t is not None and t.device != x.device:
                    raise ValueError(f"fused_moe_triton: {name} is on {t.device}, the activations on {x.device}")
        w13, w2 = x, x                                    # the dtype checks below are the activations' own
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.dtype not in _DTYPES:
            raise TypeError(f"fused_moe_triton: {name} has dtype {t.dtype}; use float32, float16 or bfloat16")
        if not t.is_contiguous():
            raise ValueError(f"fused_moe_triton: {name} must be contiguous")
    if not (x.dtype == w13.dtype == w2.dtype):
        raise TypeError(f"fused_moe_triton: x, w13, w2 dtypes differ ({x.dtype}, {w13.dtype}, {w2.dtype})")
    if not x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("fused_moe_triton needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors")


def _format(w: torch.Tensor | Fp8Weight | Mxfp4Weight, x: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int]:
    """(stored values, scales, scale strides + block, WFMT) for the kernels; dummy scales (never read) for float
    weights."""
    if isinstance(w, Fp8Weight):
        return w.values, w.scales, (*w.scales.stride(), *w.block), 1
    if isinstance(w, Mxfp4Weight):
        return w.blocks, w.scales, (*w.scales.stride(), 1, MXFP4_BLOCK), 2
    return w, x, (0, 0, 0, 1, 1), 0


def _align_on_host(ids: torch.Tensor, num_experts: int, block_m: int, device: torch.device) -> Alignment:
    """The pairs sorted by expert and padded, computed on the host and copied to the device: on a GPU the dozen
    small ops of the alignment cost 42 launches and 6 syncs a call (measured on an H200: 1.3 ms of host time a
    call, against 11 µs of the two kernels), where the host needs one copy of the ids back (one sync) and two
    copies out. The sync and the data-dependent grid keep this out of CUDA graphs, which take
    moe_align_on_device (kernels/graph_safe.py)."""
    a = moe_align_block_size(ids.cpu(), num_experts, block_m)                     # [P_pad], [P_pad / BLOCK_M]
    return Alignment(a.sorted_pair_ids.to(device), a.block_expert.to(device), a.num_pairs)   # no copy on a CPU


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor | Fp8Weight | Mxfp4Weight,
                     w2: torch.Tensor | Fp8Weight | Mxfp4Weight,
                     topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, expert_map: torch.Tensor | None = None,
                     config: LaunchConfig | None = None, out: torch.Tensor | None = None, act: GatedAct = SILU,
                     b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                     acc: torch.Tensor | None = None) -> torch.Tensor:
    _check(x, w13, w2)
    if b13 is not None and b2 is not None:
        if b13.device != x.device or b2.device != x.device:
            raise ValueError("fused_moe_triton: the biases must be on the activations' device")
        b13, b2 = b13.contiguous(), b2.contiguous()
    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2
    top_k = topk_ids.shape[1]
    cfg = config or get_config(E, I, H, str(x.dtype).removeprefix("torch."), _device_name(x), T)
    ids = local_ids(topk_ids, expert_map)                                      # [T, K] local, -1 not here
    if graph_safe_active():                  # a CUDA graph: on the device over the worst-case grid, no sync
        align = moe_align_on_device(ids, E, cfg.block_m)
    else:
        align = _align_on_host(ids, E, cfg.block_m, x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    num_blocks = align.block_expert.numel()
    if num_blocks == 0:                      # (never in graph-safe mode: its grid is the worst case)
        if acc is not None:
            return acc
        return torch.zeros(T, H, dtype=x.dtype, device=x.device) if out is None else out.zero_()
    h = torch.empty(T * top_k, I, dtype=x.dtype, device=x.device)              # [P, I]
    y = torch.zeros(T * top_k, H, dtype=torch.float32, device=x.device)        # [P, H] dropped pairs stay 0
    weights = topk_weights.reshape(-1).contiguous()                             # [P]
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    (w13, s13, s13_meta, wfmt), (w2, s2, s2_meta, _) = _format(w13, x), _format(w2, x)
    has_bias = b13 is not None
    gate_up_act_kernel[(num_blocks, triton.cdiv(I, cfg.block_n))](
        x, w13, h, align.sorted_pair_ids, align.block_expert, b13 if has_bias else x, s13,
        T * top_k, top_k, H, I,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), b13.stride(0) if has_bias else 0, *s13_meta,
        float(act.alpha), float(act.limit or 0.0), float(act.up_offset),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision,
        HAS_BIAS=has_bias, CLAMPED=act.limit is not None, WFMT=wfmt, **launch)
    down_weighted_kernel[(num_blocks, triton.cdiv(H, cfg.block_n))](
        h, w2, y, align.sorted_pair_ids, align.block_expert, weights, b2 if has_bias else x, s2,
        T * top_k, H, I,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0), b2.stride(0) if has_bias else 0, *s2_meta,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PRECISION=precision,
        HAS_BIAS=has_bias, WFMT=wfmt, **launch)
    # Σ over each token's top_k rows in float64 (exact for float32 pairs, so in any order: kernels/cpu_moe.py),
    # then one rounding: one memory-bound torch reduction (as vLLM's moe_sum)
    sums = y.view(T, top_k, H).sum(dim=1, dtype=torch.float64)                 # [T, H]
    if acc is not None:
        return acc.add_(sums)
    return sums.to(x.dtype) if out is None else out.copy_(sums)
