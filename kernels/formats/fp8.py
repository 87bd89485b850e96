"""Block-scaled FP8 weights as published (DeepSeek-V3, Kimi K2, MiniMax-M2): `<name>.weight` in float8 e4m3 with
a float32 `<name>.weight_scale_inv` [ceil(R / b0), ceil(C / b1)], one scale per b0 x b1 block (config.json's
`quantization_config.weight_block_size`, [128, 128] by default); w = value * scale.

On GPUs the experts are held so (`Fp8Weight`, half the bytes of bf16) and computed by the Triton fused MoE, which
scales each weight tile as it loads it. On CPUs every such weight is dequantised (`dequantize`) to the compute
dtype when it is read: the router's at load, a worker's expert by expert as it packs.

Shapes: E experts, R rows (outputs), C columns (inputs), b0 x b1 the block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_SUFFIX = "_scale_inv"           # `<name>.weight` + this = its block scales in the checkpoint
DEFAULT_BLOCK = (128, 128)
E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max     # 448


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


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """e4m3 weight [..., R, C] times its blocks' scales [..., ceil(R/b0), ceil(C/b1)] -> float32 [..., R, C]."""
    R, C = weight.shape[-2:]
    b0, b1 = block
    want = (*weight.shape[:-2], -(-R // b0), -(-C // b1))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"an FP8 weight {list(weight.shape)} with blocks {b0}x{b1} needs scales "
                         f"{list(want)}, got {list(scale_inv.shape)}")
    s = scale_inv.float().repeat_interleave(b0, dim=-2)[..., :R, :].repeat_interleave(b1, dim=-1)[..., :C]
    return weight.float() * s                                                              # [..., R, C]


def quantize(weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The publishers' recipe (for tests and tools): per-block scale = amax / 448, e4m3 = round(w / scale)."""
    R, C = weight.shape[-2:]
    b0, b1 = block
    nr, nc = -(-R // b0), -(-C // b1)
    padded = torch.zeros(*weight.shape[:-2], nr * b0, nc * b1, dtype=torch.float32)
    padded[..., :R, :C] = weight.float()
    blocks = padded.unflatten(-1, (nc, b1)).unflatten(-3, (nr, b0))                   # [..., nr, b0, nc, b1]
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12)                           # [..., nr, nc]
    scale = amax / E4M3_MAX
    s = scale.repeat_interleave(b0, dim=-2)[..., :R, :].repeat_interleave(b1, dim=-1)[..., :C]
    return (weight.float() / s).to(torch.float8_e4m3fn), scale
