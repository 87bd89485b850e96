"""The small numeric building blocks of the decoder, written to match transformers' maths exactly.

Shapes: T tokens, H hidden size, D head dim, I an MLP's width.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from colibri_common.rope_scaling import RopeScaling
from kernels import linear, native

RowMap = Callable[..., Any]     # (fn, *tensors with T rows) -> fn's result for all T rows
TABLE_POSITIONS = 1 << 16       # positions a Rope's table covers at most (2 x 64Ki x R values); beyond, computed


def whole(fn: Callable[..., Any], *xs: torch.Tensor) -> Any:
    """fn on all rows at once: the batched form."""
    return fn(*xs)


def by_row(fn: Callable[..., Any], *xs: torch.Tensor) -> Any:
    """fn on one row of `xs` at a time, the results (a tensor or a tuple of them) concatenated: batch invariance,
    where every op sees the shapes of one token, so neither a kernel's blocking nor an elementwise loop's
    vectorised tail can depend on the other rows."""
    T = xs[0].shape[0]
    if T <= 1:
        return fn(*xs)
    outs = [fn(*(x[i:i + 1] for x in xs)) for i in range(T)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
    return torch.cat(outs)


_ROPE_TYPES = (torch.float32, torch.bfloat16)
NORM_TYPES = {(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, scale in the input dtype (as transformers' RMSNorm does); a float32 weight on lower
    precision activations scales in float32, then casts (GPT-OSS's norms, kept in float32). On a GPU, torch's fused
    norm; on a CPU with the native kernels, one call (kernels.native.rms_norm: the same maths, its mean from a
    float64 sum); else torch's ops below."""
    if x.is_cuda:      # the norm in torch's fused kernel: 4 launches where the ops below take 8
        return _scaled(F.rms_norm(x.float(), (x.shape[-1],), eps=eps), weight, x.dtype)
    if native.decoder_ops() and (x.dtype, weight.dtype) in NORM_TYPES:
        return native.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` in torch's ops (GPUs, other dtypes, and the reference the native op is tested against)."""
    xf = x.float()
    return _scaled(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps), weight, x.dtype)


def _scaled(xf: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The normalised float32 rows times the weight, cast as transformers casts: a float32 weight on lower precision
    activations scales in float32 and casts after; else the rows are cast, then scaled."""
    if weight.dtype == torch.float32 and dtype != torch.float32:
        return (weight * xf).to(dtype)
    return weight * xf.to(dtype)


class Rope:
    """Rotary embedding over `dim` dims (a head's leading ones): inverse frequencies in float32, with linear or
    YaRN scaling as transformers computes them (modeling_rope_utils), cos/sin times the attention factor, cast
    to the activation dtype."""

    def __init__(self, dim: int, theta: float, device: torch.device | str = "cpu",
                 scaling: RopeScaling | None = None) -> None:
        s = scaling or RopeScaling()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))          # [R/2]
        self.attention_scaling = 1.0
        if s.type == "linear":
            inv_freq = inv_freq / s.factor
        elif s.type == "yarn":
            inv_freq, self.attention_scaling = _yarn(dim, theta, s)
        self.inv_freq = inv_freq.to(device)

        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}   # dtype -> cos, sin [N, R]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype, top: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R] of `positions` [T] in `dtype`. On the CPU, with `top` >= every position (known on the host:
        nothing is read back), rows of a table of positions 0..N-1 made by the same elementwise ops (so the same
        values; grown as positions come, up to TABLE_POSITIONS): cos and sin of a few hundred values each step took
        ~0.2 ms of every step from 8 rows on, ~0.7 ms in a busy router. Else computed."""
        if positions.device.type != "cpu" or not 0 <= top < TABLE_POSITIONS:
            return self._computed(positions, dtype)
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] <= top:
            table = self._computed(torch.arange(min(TABLE_POSITIONS, max(256, 2 << top.bit_length()))), dtype)
            self._tables[dtype] = table                                 # [N, R] each
        return table[0].index_select(0, positions), table[1].index_select(0, positions)   # [T, R] each

    def _computed(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The angles in float32 as transformers makes them; on the CPU their cos and sin in float64 by numpy, rounded
        to float32 (the correctly rounded values, where torch's float32 ones are within an ulp). torch 2.13's float32
        `cos` of a few thousand values on two threads (MKL's AVX-512 VML) came out with errors up to 1.5e-4 in one
        thread's half in about a third of the processes on an Intel Xeon (sin was right): a fleet whose router built
        its table so computed otherwise than the others (docs/models.md)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]   # [T, R/2]
        if freqs.device.type == "cpu":                                  # one thread, into torch's own buffers
            angles = freqs.double()                                      # (no host tensor made from Python data)
            cos, sin = torch.empty_like(angles), torch.empty_like(angles)
            np.cos(angles.numpy(), out=cos.numpy())
            np.sin(angles.numpy(), out=sin.numpy())
            cos, sin = cos.float(), sin.float()
        else:
            cos, sin = freqs.cos(), freqs.sin()
        a = self.attention_scaling
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)   # [T, R]
        return (cos * a).to(dtype), (sin * a).to(dtype)


def _yarn(dim: int, base: float, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies [R/2] and attention factor (arXiv 2309.00071, as transformers writes it)."""

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = s.factor
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = mscale(factor, s.mscale) / mscale(factor, s.mscale_all_dim)
    else:
        attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                                                  # no singularity
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)                     # [R/2]
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)    # [R/2]
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, R]: the first R <= D dims of each head rotate, the rest pass (partial
    rotary, as transformers' apply_rotary_pos_emb). On a CPU with the native kernels one call with the same bits
    (kernels.native.rope); else the torch ops below."""
    if not x.is_cuda and native.decoder_ops() and x.dtype in _ROPE_TYPES and cos.dtype == x.dtype:
        return native.rope(x, cos, sin)
    return apply_rope_torch(x, cos, sin)


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in torch's ops (GPUs, other dtypes, and the bits the native op must give)."""
    R = cos.shape[-1]
    rot = x if R == x.shape[-1] else x[..., :R]                       # [T, heads, R]
    half = R // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)  # [T, heads, R]
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return out if R == x.shape[-1] else torch.cat((out, x[..., R:]), dim=-1)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary layout: pairs (x0, x1), (x2, x3), ... each rotated by one frequency. x [T, heads, R];
    cos/sin [T, R] as Rope gives them (the first half holds the per-pair angles). The result lists the rotated
    first members then the second ones (transformers' apply_rotary_pos_emb_interleave); queries and keys get
    the same layout, so their products are DeepSeek's."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]                   # [T, 1, R/2]
    x1, x2 = x[..., 0::2], x[..., 1::2]                                # [T, heads, R/2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def silu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU MLP with fused gate/up rows: gate_up [2I, H], down [H, I]."""
    gu = linear(x, gate_up)                                            # [T, 2I]
    i = down.shape[1]
    return linear(torch.nn.functional.silu(gu[:, :i]) * gu[:, i:], down)  # [T, H]
