"""Block-scaled FP8 expert weights kept as published (DeepSeek-V3, Kimi K2, MiniMax-M2): e4m3 values with one
float32 scale per b0 x b1 block, w = value * scale. Held so on GPUs (half the bytes of bf16) and computed by the
Triton fused MoE, which scales each weight tile as it loads it (the activations stay in the compute dtype).

Shapes: E experts, R rows (outputs), C columns (inputs), b0 x b1 the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Weight:
    values: torch.Tensor          # [..., R, C] float8_e4m3fn
    scales: torch.Tensor          # [..., ceil(R / b0), ceil(C / b1)] float32
    block: tuple[int, int]

    def __post_init__(self) -> None:
        R, C = self.values.shape[-2:]
        b0, b1 = self.block
        want = (*self.values.shape[:-2], -(-R // b0), -(-C // b1))
        if self.values.dtype != torch.float8_e4m3fn or self.scales.dtype != torch.float32 or \
                tuple(self.scales.shape) != want:
            raise ValueError(f"Fp8Weight: need e4m3 values and float32 scales {list(want)} for blocks {b0}x{b1}, got "
                             f"{self.values.dtype} {list(self.values.shape)}, {self.scales.dtype} "
                             f"{list(self.scales.shape)}")

    @staticmethod
    def empty(*shape: int, block: tuple[int, int], device: torch.device | str = "cpu") -> Fp8Weight:
        """Uninitialised storage for `shape` = (..., R, C), filled by `fill`."""
        R, C = shape[-2:]
        scales = (*shape[:-2], -(-R // block[0]), -(-C // block[1]))
        return Fp8Weight(torch.empty(shape, dtype=torch.float8_e4m3fn, device=device),
                         torch.empty(scales, dtype=torch.float32, device=device), block)

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def is_cuda(self) -> bool:
        return self.values.is_cuda

    @property
    def device(self) -> torch.device:
        return self.values.device

    def dim(self) -> int:
        return self.values.dim()

    def __getitem__(self, index: int) -> Fp8Weight:
        """One expert of a stack (an index along the first dimension)."""
        return Fp8Weight(self.values[index], self.scales[index], self.block)

    @property
    def nbytes(self) -> int:
        return self.values.numel() + self.scales.numel() * 4

    def fill(self, row: int, values: torch.Tensor, scales: torch.Tensor) -> None:
        """Rows row.. of this [R, C] weight from a published e4m3 weight and its block scales; `row` must start a
        block, so the source's scale grid lines up with this one's."""
        if row % self.block[0]:
            raise ValueError(f"Fp8Weight.fill: row {row} does not start a {self.block[0]}-row block")
        self.values[row:row + values.shape[0]].copy_(values)
        b = row // self.block[0]
        self.scales[b:b + scales.shape[0]].copy_(scales)

    def copy_(self, other: Fp8Weight) -> Fp8Weight:
        """Another Fp8Weight of the same shape and block (a warm tier's slot into a hot one)."""
        if not isinstance(other, Fp8Weight) or other.block != self.block:
            raise TypeError("Fp8Weight.copy_ takes an Fp8Weight of the same block size")
        self.values.copy_(other.values)
        self.scales.copy_(other.scales)
        return self

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[..., R, C] in `dtype`: each value times its block's scale."""
        R, C = self.values.shape[-2:]
        b0, b1 = self.block
        s = self.scales.repeat_interleave(b0, dim=-2)[..., :R, :].repeat_interleave(b1, dim=-1)[..., :C]
        return (self.values.float() * s).to(dtype)
