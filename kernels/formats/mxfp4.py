"""MXFP4 weights as GPT-OSS publishes its experts (OCP microscaling): per output row, blocks of 32 e2m1 values
(16 bytes, two values a byte, low nibble first) and one e8m0 scale byte each (2^(s - 127)); the checkpoint holds
`<name>_blocks` [.., R, C / 32, 16] and `<name>_scales` [.., R, C / 32] uint8.

On GPUs the experts are held so (`Mxfp4Weight`, 4.25 bits a weight) and computed by the Triton fused MoE, which
decodes each tile's nibbles and scales as it loads them (kernels/triton_moe_kernel.py takes BLOCK and
SCALE_BIAS from here). On CPUs a worker dequantises them (`dequantize`) expert by expert as it packs.

Shapes: E experts, R rows (outputs), C columns (inputs, a multiple of 32), G = C / 32 blocks of a row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32                  # values per block: 16 bytes of e2m1 pairs and one scale byte
SCALE_BIAS = 127            # e8m0: a block's scale is 2^(s - SCALE_BIAS)
# e2m1: sign, two exponent bits, one mantissa bit; codes 0..7 positive, 8..15 their negatives
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_CODES = torch.arange(256)
_PAIRS = torch.tensor(E2M1, dtype=torch.float32)[torch.stack([_CODES & 0x0F, _CODES >> 4], dim=-1)]   # [256, 2]


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


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., R, G, 16] uint8 and scales [..., R, G] uint8 -> float32 [..., R, 32 G]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} need scales {list(blocks.shape[:-1])} and "
                         f"{BLOCK // 2} bytes a block; got scales {list(scales.shape)}")
    if bool((scales == 255).any()):
        raise ValueError("an MXFP4 scale byte is 255, which the MX format defines as NaN (a corrupt or truncated "
                         "tensor)")
    values = _PAIRS[blocks.int()]                                               # [..., R, G, 16, 2]
    scale = torch.pow(2.0, scales.float() - SCALE_BIAS)                        # [..., R, G] exact powers of 2
    return (values.flatten(-2) * scale[..., None]).flatten(-2)                  # [..., R, G * 32]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., R, C] (C a multiple of 32) -> (blocks [..., R, C / 32, 16], scales [..., R, C / 32]): each
    block's scale the power of two that brings its largest magnitude within e2m1's 6, values rounded to the
    nearest code. For building test checkpoints as GPT-OSS publishes them."""
    *lead, R, C = weight.shape
    if C % BLOCK:
        raise ValueError(f"MXFP4 rows must be a multiple of {BLOCK} values, got {C}")
    w = weight.float().reshape(*lead, R, C // BLOCK, BLOCK)                     # [..., R, G, 32]
    amax = w.abs().amax(-1).clamp(min=2.0**-126)                                # [..., R, G]
    exp = (torch.floor(torch.log2(amax)) - 2).clamp(-SCALE_BIAS, 127)           # 6 = 1.5 * 2^2
    scaled = w / torch.ldexp(torch.ones_like(exp), exp.int())[..., None]
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(-1).to(torch.uint8)          # [..., R, G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)                         # [..., R, G, 16]
    return blocks, (exp + SCALE_BIAS).to(torch.uint8)
