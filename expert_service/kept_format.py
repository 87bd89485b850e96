"""Quantised experts kept as the checkpoint publishes them, for the Triton kernels to compute: block-scaled FP8
(`kernels.Fp8Weight`) or GPT-OSS's MXFP4 (`kernels.Mxfp4Weight`). Which one a worker holds, if any, follows
`--quantized-experts` (auto | keep | dequantize) and the device.

Shapes: H hidden size, I expert width, b0 x b1 an FP8 block.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.errors import ConfigError
from colibri_common.tensors import stored_expert_tensors
from kernels import Fp8Weight, Mxfp4Weight

MODES = ("auto", "keep", "dequantize")


@dataclass(frozen=True)
class Kept:
    kind: str                               # "fp8" | "mxfp4"
    block: tuple[int, int] = (1, 32)        # FP8's b0 x b1; MXFP4's is one row by 32 values

    def empty(self, *shape: int, device: torch.device | str = "cpu") -> Fp8Weight | Mxfp4Weight:
        if self.kind == "fp8":
            return Fp8Weight.empty(*shape, block=self.block, device=device)
        return Mxfp4Weight.empty(*shape, device=device)

    def pinned(self, *shape: int) -> Fp8Weight | Mxfp4Weight:
        """Host memory pinned for a GPU worker's warm tier (allocated pinned: no copy of a large tier)."""
        meta = self.empty(*shape, device="meta")
        tensors = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in
                   ((meta.values, meta.scales) if isinstance(meta, Fp8Weight) else (meta.blocks, meta.scales))]
        return Fp8Weight(*tensors, self.block) if self.kind == "fp8" else Mxfp4Weight(*tensors)

    def expert_bytes(self, cfg: ModelConfig) -> int:
        """One expert's gate/up [2I, H] and down [H, I] held so: values and scales."""
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        if self.kind == "mxfp4":
            return 3 * H * I // 2 + 3 * H * I // 32
        b0, b1 = self.block
        return 3 * H * I + 4 * (-(-2 * I // b0) * -(-H // b1) + -(-H // b0) * -(-I // b1))

    @property
    def dtype_name(self) -> str:
        return "float8_e4m3fn" if self.kind == "fp8" else "mxfp4"


def kept_format(cfg: ModelConfig, ckpt: Checkpoint, device: torch.device, mode: str, quantize: str | None
                ) -> Kept | None:
    """The format to keep a quantised checkpoint's experts in, or None to dequantise them as they are packed.
    auto: kept on a CUDA GPU (FP8 only on one with FP8, compute capability 8.9+)."""
    if mode not in MODES:
        raise ConfigError(f"--quantized-experts '{mode}': use one of {', '.join(MODES)}")
    if mode == "dequantize" or not cfg.moe_layers:
        return None
    layout, specs = stored_expert_tensors(cfg, cfg.moe_layers[0], 0, ckpt)
    I = cfg.moe_intermediate_size
    other = _unlike(cfg, ckpt, layout, {ckpt.entry(name).dtype for name, _ in specs.values()})
    if other is not None:          # a checkpoint that left some experts unquantised (modules_to_not_convert)
        if mode == "keep":
            raise ConfigError(f"--quantized-experts keep: {other} is not stored as the first MoE layer's experts "
                              f"are ({layout}); use --quantized-experts dequantize")
        return None
    if layout == "mxfp4":
        kept, fp8_gpu = Kept("mxfp4"), True
        aligned = cfg.hidden_size % 32 == 0 and I % 32 == 0               # rows of whole 32-value blocks
    elif all(ckpt.entry(name).dtype == "F8_E4M3" for name, _ in specs.values()) and ckpt.fp8 is not None:
        kept = Kept("fp8", ckpt.fp8.block)
        aligned = layout == "stacked" or I % kept.block[0] == 0   # gate's and up's scale grids stack into one
        fp8_gpu = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    else:
        if mode == "keep":
            raise ConfigError(f"--quantized-experts keep: {ckpt.dir}'s experts are neither block-scaled FP8 nor "
                              f"MXFP4")
        return None
    if mode == "auto":
        return kept if device.type == "cuda" and fp8_gpu and aligned and quantize is None else None
    if quantize is not None:
        raise ConfigError("--quantized-experts keep and --quantize int8 exclude each other: keep the checkpoint's "
                          "format or quantise dequantised experts, not both")
    if not aligned:
        raise ConfigError(f"--quantized-experts keep: the expert width {I} (hidden {cfg.hidden_size}) does not "
                          f"split into whole {kept.kind} blocks ({kept.block[0]} rows for FP8, 32 values for MXFP4); "
                          f"use --quantized-experts dequantize")
    if kept.kind == "fp8" and device.type == "cuda" and not fp8_gpu:
        raise ConfigError(f"--quantized-experts keep: {torch.cuda.get_device_name(device)} (compute capability "
                          f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}) has no FP8; it needs "
                          f"8.9+ (Ada, Hopper, Blackwell): use --quantized-experts dequantize")
    interpreted = os.environ.get("COLIBRI_MOE_BACKEND") == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        raise ConfigError("--quantized-experts keep on a CPU needs the Triton kernels (COLIBRI_MOE_BACKEND=triton "
                          "under TRITON_INTERPRET=1, a test setup); CPU workers compute dequantised experts")
    return kept


def _unlike(cfg: ModelConfig, ckpt: Checkpoint, layout: str, first: set[str]) -> str | None:
    """The first expert tensor of any MoE layer not stored as the first layer's expert 0 (`layout`, its tensors'
    dtypes `first`: FP8 where those are), or None: a format is kept for all the experts or for none (header reads
    only)."""
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts if layout == "per_expert" else 1):
            lay, specs = stored_expert_tensors(cfg, layer, e, ckpt)
            if lay != layout:
                return f"layer {layer}'s experts ({lay})"
            for name, _ in specs.values():
                if "F8_E4M3" in first and ckpt.entry(name).dtype != "F8_E4M3":
                    return f"'{name}' ({ckpt.entry(name).dtype})"
    return None
