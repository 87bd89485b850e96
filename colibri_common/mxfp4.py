"""MXFP4 weights as GPT-OSS publishes its experts (OCP microscaling): each output row split into blocks of 32
values, a block stored as 16 bytes of e2m1 pairs (low nibble first) and one e8m0 scale byte (2^(s - 127)).
On CPU a worker dequantises them expert by expert as it packs, so the kernels see the compute dtype.

Shapes: R rows (outputs), G blocks of a row, C = 32 G columns (inputs).
"""

from __future__ import annotations

import torch

from colibri_common.errors import CheckpointError

BLOCK = 32
# e2m1: sign, two exponent bits, one mantissa bit; codes 0..7 positive, 8..15 their negatives
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
_CODES = torch.arange(256)
_PAIRS = torch.tensor(E2M1, dtype=torch.float32)[torch.stack([_CODES & 0x0F, _CODES >> 4], dim=-1)]   # [256, 2]


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., R, G, 16] uint8 and scales [..., R, G] uint8 -> float32 [..., R, 32 G]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(f"MXFP4 blocks {list(blocks.shape)} need scales {list(blocks.shape[:-1])} and "
                              f"{BLOCK // 2} bytes a block; got scales {list(scales.shape)}")
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
