"""MXFP4 expert weights kept as GPT-OSS publishes them: per output row, blocks of 32 e2m1 values (16 bytes, two
values a byte, low nibble first) and one e8m0 scale byte each (2^(s - 127)). Held so on GPUs (4.25 bits a
weight) and computed by the Triton fused MoE, which decodes each tile's nibbles and scales as it loads them.

Shapes: E experts, R rows (outputs), C columns (inputs, a multiple of 32), G = C / 32 blocks of a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32


@dataclass(frozen=True)
class Mxfp4Weight:
    blocks: torch.Tensor          # [..., R, C / 2] uint8: columns 2j (low nibble) and 2j + 1 (high nibble)
    scales: torch.Tensor          # [..., R, C / 32] uint8 e8m0

    def __post_init__(self) -> None:
        if self.blocks.dtype != torch.uint8 or self.scales.dtype != torch.uint8 or \
                self.blocks.shape[:-1] != self.scales.shape[:-1] or self.blocks.shape[-1] * 2 != \
                self.scales.shape[-1] * BLOCK:
            raise ValueError(f"Mxfp4Weight: need uint8 blocks [.., R, C/2] and scales [.., R, C/32], got "
                             f"{self.blocks.dtype} {list(self.blocks.shape)}, {self.scales.dtype} "
                             f"{list(self.scales.shape)}")

    @staticmethod
    def empty(*shape: int, device: torch.device | str = "cpu") -> Mxfp4Weight:
        """Uninitialised storage for `shape` = (..., R, C), filled by `fill`."""
        *lead, R, C = shape
        if C % BLOCK:
            raise ValueError(f"Mxfp4Weight: rows of {C} values are not whole {BLOCK}-value blocks")
        return Mxfp4Weight(torch.empty(*lead, R, C // 2, dtype=torch.uint8, device=device),
                           torch.empty(*lead, R, C // BLOCK, dtype=torch.uint8, device=device))

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.blocks.shape[:-1], self.blocks.shape[-1] * 2))

    @property
    def dtype(self) -> str:
        return "mxfp4"

    @property
    def is_cuda(self) -> bool:
        return self.blocks.is_cuda

    def dim(self) -> int:
        return self.blocks.dim()

    def __getitem__(self, index: int) -> Mxfp4Weight:
        """One expert of a stack (an index along the first dimension)."""
        return Mxfp4Weight(self.blocks[index], self.scales[index])

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() + self.scales.numel()

    def fill(self, row: int, blocks: torch.Tensor, scales: torch.Tensor) -> None:
        """Rows row.. of this [R, C] weight from published blocks [n, C / 32, 16] (or [n, C / 2]) and scales."""
        n = blocks.shape[0]
        self.blocks[row:row + n].copy_(blocks.reshape(n, -1))
        self.scales[row:row + n].copy_(scales)

    def copy_(self, other: Mxfp4Weight) -> Mxfp4Weight:
        """Another Mxfp4Weight of the same shape (a warm tier's slot into a hot one)."""
        if not isinstance(other, Mxfp4Weight):
            raise TypeError("Mxfp4Weight.copy_ takes an Mxfp4Weight")
        self.blocks.copy_(other.blocks)
        self.scales.copy_(other.scales)
        return self
