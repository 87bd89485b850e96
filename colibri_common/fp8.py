"""FP8 checkpoints as published (DeepSeek-V3, Kimi K2, MiniMax-M2): `<name>.weight` in float8 e4m3 with a
float32 `<name>.weight_scale_inv` [ceil(rows / b0), ceil(cols / b1)], one scale per b0 x b1 block
(`quantization_config.weight_block_size`, [128, 128] by default). The real weight is the e4m3 value times its
block's scale. On CPU every such weight is dequantised to the compute dtype when it is read (the router's at
load, a worker's expert by expert as it packs), so everything downstream is unchanged.

Shapes: R rows, C columns of a weight; b0 x b1 the block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from colibri_common.errors import CheckpointError

SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class Fp8Format:
    block: tuple[int, int] = (128, 128)

    @staticmethod
    def from_dir(model_dir: Path) -> Fp8Format | None:
        """The checkpoint's FP8 format from config.json's quantization_config, or None when it has none."""
        path = model_dir / "config.json"
        try:
            raw = json.loads(path.read_text()) if path.is_file() else {}
        except ValueError:
            return None                         # config.json's own loader reports a bad file
        q = raw.get("quantization_config") or {}
        if q.get("quant_method") == "compressed-tensors":
            raise CheckpointError(f"{path}: quantization_config is compressed-tensors (per-channel weight_scale, as "
                                  f"GLM-4.5-FP8 ships); only block-scaled FP8 (quant_method fp8 with "
                                  f"weight_scale_inv) is read: serve the bf16 checkpoint instead")
        if q.get("quant_method") != "fp8":
            return None
        if q.get("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn") or \
                q.get("activation_scheme", "dynamic") not in ("dynamic", None):
            raise CheckpointError(f"{path}: quantization_config {q} is not the block-scaled e4m3 FP8 format "
                                  f"(fmt e4m3, dynamic activations) that can be read")
        block = q.get("weight_block_size") or [128, 128]
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise CheckpointError(f"{path}: quantization_config.weight_block_size must be two positive ints, "
                                  f"got {block}")
        return Fp8Format((block[0], block[1]))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 weight [..., R, C] times its blocks' scales [..., ceil(R/b0), ceil(C/b1)] -> float32 [..., R, C]."""
    R, C = weight.shape[-2:]
    b0, b1 = block
    want = (*weight.shape[:-2], -(-R // b0), -(-C // b1))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"an FP8 weight {list(weight.shape)} with blocks {b0}x{b1} needs scales "
                              f"{list(want)}, got {list(scale_inv.shape)}")
    s = scale_inv.float().repeat_interleave(b0, dim=-2)[..., :R, :].repeat_interleave(b1, dim=-1)[..., :C]
    return weight.float() * s                                                              # [..., R, C]


def quantize(weight: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """The publishers' recipe (for tests and tools): per-block scale = amax / 448, e4m3 = round(w / scale)."""
    R, C = weight.shape[-2:]
    b0, b1 = block
    nr, nc = -(-R // b0), -(-C // b1)
    padded = torch.zeros(*weight.shape[:-2], nr * b0, nc * b1, dtype=torch.float32)
    padded[..., :R, :C] = weight.float()
    blocks = padded.unflatten(-1, (nc, b1)).unflatten(-3, (nr, b0))                   # [..., nr, b0, nc, b1]
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12)                           # [..., nr, nc]
    scale = amax / torch.finfo(torch.float8_e4m3fn).max
    s = scale.repeat_interleave(b0, dim=-2)[..., :R, :].repeat_interleave(b1, dim=-1)[..., :C]
    return (weight.float() / s).to(torch.float8_e4m3fn), scale
