"""Symmetric per-output-channel int8 weights: w ≈ q * scale, q in [-127, 127], one float32 scale per row.

Made at load time from float checkpoints (`quantize_int8`, row by row, so no float copy of a whole shard
is ever held), computed by the int8 forms of `kernels/cpu_forms.py`: weight-only (`torch._weight_int8pack_mm` or
a dequantising GEMM, the activations as they are), or, for W8A8 weights (`w8a8=True`, `--quantize w8a8`), on
per-row int8 activations with int32 sums (`torch._int_mm`).

Shapes: E experts, Dout output features (one scale each), Din input features, n rows of x.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

QUANTIZE_MODES = ("int8", "w8a8")      # weight-only int8; int8 weights and per-row int8 activations


@dataclass(frozen=True)
class Int8Weight:
    q: torch.Tensor          # [..., Dout, Din] int8
    scale: torch.Tensor      # [..., Dout] float32
    w8a8: bool = False       # the activations are quantised per row too (int8 x int8 products)
    act_dtype: torch.dtype | None = None   # the dtype the activations are multiplied in, when not theirs: the
    #                                        dtype the user chose, where the router computes in float32

    @staticmethod
    def empty(*shape: int, w8a8: bool = False) -> Int8Weight:
        """Uninitialised storage for `shape` = (..., Dout, Din), to be filled by `copy_`."""
        return Int8Weight(torch.empty(shape, dtype=torch.int8), torch.empty(shape[:-1], dtype=torch.float32), w8a8)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.int8

    @property
    def is_cuda(self) -> bool:
        return self.q.is_cuda

    def dim(self) -> int:
        return self.q.dim()

    def __getitem__(self, index) -> Int8Weight:
        return Int8Weight(self.q[index], self.scale[index], self.w8a8, self.act_dtype)

    @cached_property
    def rows(self) -> list[Int8Weight]:
        """self[i] for every i along the first dimension, made once (an expert stack's per-expert views)."""
        return [self[i] for i in range(self.q.shape[0])]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def copy_(self, w: torch.Tensor) -> Int8Weight:
        """Quantise float `w` (same shape) into this storage."""
        src = quantize_int8(w)
        self.q.copy_(src.q)
        self.scale.copy_(src.scale)
        return self

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.to(torch.float32) * self.scale[..., None]).to(dtype)       # [..., Dout, Din]


def quantize_int8(w: torch.Tensor, w8a8: bool = False, act_dtype: torch.dtype | None = None) -> Int8Weight:
    """Per output channel: scale = max|w_row| / 127, q = round(w / scale)."""
    wf = w.float()                                                                 # [..., Dout, Din]
    scale = (wf.abs().amax(dim=-1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)  # [..., Dout]
    q = torch.round(wf / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous(), w8a8, act_dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-row activation quantisation: x [n, Din] -> (int8 [n, Din], float32 scale [n])."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)   # [n]
    return torch.round(xf / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


X16_BLOCK = 256     # elements of Din one int16 scale of x covers (kernels/native/gemm.h QB)


def quantize_x16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x as the native levels' weight-only int8 linear multiplies it, every level but generic (gemm.h, CK_X16): each
    row in blocks of X16_BLOCK along Din, a block's scale amax / 32767 and q = round-half-even(x * (32767 / amax)),
    float32 arithmetic (a block whose amax is below 2^-64 scaled up by 2^64 first, exactly, so that 32767 / amax
    stays finite); a zero block has scale 0, a block holding inf or NaN scale NaN (and q 0).
    x [n, Din] -> (int16 [n, Din], float32 scale [n, blocks])."""
    xf = x.float()
    n, din = xf.shape
    blocks = -(-din // X16_BLOCK)
    padded = torch.zeros(n, blocks * X16_BLOCK, dtype=torch.float32)
    padded[:, :din] = xf
    b = padded.view(n, blocks, X16_BLOCK)                                                    # [n, blocks, B]
    amax = b.abs().amax(dim=-1)                                                              # [n, blocks]
    finite = torch.isfinite(b).all(dim=-1)                                                   # [n, blocks]
    usable = finite & (amax > 0)
    up = torch.where(amax < 2.0**-64, 2.0**64, 1.0)                                          # [n, blocks]
    r = torch.where(usable, torch.tensor(32767.0) / torch.where(usable, amax * up, 1.0), 0.0)   # [n, blocks]
    q = torch.round(torch.where(usable[..., None], b, 0.0) * up[..., None] * r[..., None]).to(torch.int16)
    scale = torch.where(finite, torch.where(usable, amax / 32767.0, 0.0), float("nan"))
    return q.view(n, -1)[:, :din], scale
