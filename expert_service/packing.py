"""Pack one expert from the checkpoint's mapped bytes into compute-ready storage, in any layout on disk.

The published layouts (colibri_common.tensors.stored_expert_tensors): one tensor per expert and projection
(`experts.{e}.gate_proj.weight`, …); the experts of a layer stacked (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]); GPT-OSS's transposed, interleaved ones (`gate_up_proj` [E, H, 2I] with gate
and up columns alternating, `down_proj` [E, I, H]) or their MXFP4 blocks and scales. Packing converts to the
storage's dtype (or quantises to int8) as it copies, then drops the mapped pages it read, so reading an
expert costs its packed size in memory and nothing more. Experts' biases (GPT-OSS) are read per layer.

Shapes: H hidden size, I expert width, E experts per layer, E_local experts held here.
"""

from __future__ import annotations

import torch

from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.errors import CheckpointError
from colibri_common.tensors import expert_bias_tensors, stored_expert_tensors
from kernels import Fp8Weight, Mxfp4Weight, Weight, fp8, mxfp4


def pack_expert(cfg: ModelConfig, ckpt: Checkpoint, layer: int, expert: int, w13: Weight, w2: Weight,
                release: bool = True) -> None:
    """Global `expert` of `layer` into w13 [2I, H] (gate rows, then up rows) and w2 [H, I]."""
    I = cfg.moe_intermediate_size
    layout, t = stored_expert_tensors(cfg, layer, expert, ckpt)
    if isinstance(w13, Fp8Weight) and isinstance(w2, Fp8Weight):
        _pack_fp8(cfg, ckpt, layout, t, expert, w13, w2, release)
        return
    if isinstance(w13, Mxfp4Weight) and isinstance(w2, Mxfp4Weight):
        _pack_mxfp4(cfg, ckpt, layout, t, expert, w13, w2, release)
        return
    if layout == "per_expert":
        (g, gs), (u, us), (d, ds) = t["gate"], t["up"], t["down"]
        w13[:I].copy_(ckpt.tensor(g, gs))
        w13[I:].copy_(ckpt.tensor(u, us))
        w2.copy_(ckpt.tensor(d, ds))
        if release:
            for name in (g, u, d):
                ckpt.release(name)
        return
    if layout == "mxfp4":
        if cfg.hidden_size % mxfp4.BLOCK or I % mxfp4.BLOCK:
            raise CheckpointError(f"{t['gate_up_blocks'][0]}: MXFP4 needs hidden_size and intermediate_size in whole "
                                  f"{mxfp4.BLOCK}-value blocks, got {cfg.hidden_size} and {I}")
        for spec in t.values():
            ckpt.check(*spec)
        gate_up = ckpt.mxfp4(t["gate_up_blocks"][0], t["gate_up_scales"][0], expert)     # [2I, H] interleaved
        w13[:I].copy_(gate_up[0::2])
        w13[I:].copy_(gate_up[1::2])
        w2.copy_(ckpt.mxfp4(t["down_blocks"][0], t["down_scales"][0], expert))          # [H, I]
    else:
        (gu_name, gu_shape), (d_name, d_shape) = t["gate_up"], t["down"]
        gate_up, down = ckpt.tensor(gu_name, gu_shape, expert), ckpt.tensor(d_name, d_shape, expert)
        if layout == "interleaved_t":                        # [H, 2I] gate, up alternating; down [I, H]
            w13[:I].copy_(gate_up[:, 0::2].T)
            w13[I:].copy_(gate_up[:, 1::2].T)
            w2.copy_(down.T)
        else:
            w13.copy_(gate_up)
            w2.copy_(down)
    if release:
        for name, _ in t.values():
            ckpt.release(name, expert)


def _pack_fp8(cfg: ModelConfig, ckpt: Checkpoint, layout: str, t: dict[str, tuple[str, tuple[int, ...]]],
              expert: int, w13: Fp8Weight, w2: Fp8Weight, release: bool) -> None:
    """The published e4m3 values and block scales as they are (no dequantisation): gate rows then up rows."""
    def raw(name: str, shape: tuple[int, ...], index: int | None) -> tuple:
        if ckpt.check(name, shape).dtype != "F8_E4M3":
            raise CheckpointError(f"{ckpt.entry(name).file}: '{name}' is {ckpt.entry(name).dtype}, but the experts "
                                  f"are held in FP8: every expert weight must be FP8 (or serve --quantized-experts "
                                  f"dequantize)")
        ckpt.check_fp8(name)
        v, sc = ckpt.view(name), ckpt.view(name + fp8.SCALE_SUFFIX)
        return (v, sc) if index is None else (v[index], sc[index])

    if layout == "per_expert":
        (g, gs), (u, us), (d, ds) = t["gate"], t["up"], t["down"]
        w13.fill(0, *raw(g, gs, None))
        w13.fill(cfg.moe_intermediate_size, *raw(u, us, None))
        w2.fill(0, *raw(d, ds, None))
    elif layout == "stacked":
        w13.fill(0, *raw(*t["gate_up"], expert))
        w2.fill(0, *raw(*t["down"], expert))
    else:
        raise CheckpointError(f"experts in the {layout} layout are not FP8; serve them with --quantized-experts "
                              f"dequantize")
    if release:
        for name, _ in t.values():
            ckpt.release(name, None if layout == "per_expert" else expert)


def _pack_mxfp4(cfg: ModelConfig, ckpt: Checkpoint, layout: str, t: dict[str, tuple[str, tuple[int, ...]]],
                expert: int, w13: Mxfp4Weight, w2: Mxfp4Weight, release: bool) -> None:
    """GPT-OSS's MXFP4 blocks and scales as they are: gate_up's alternating rows split into gate rows, then up."""
    if layout != "mxfp4":
        raise CheckpointError(f"experts in the {layout} layout are not MXFP4; serve them with --quantized-experts "
                              f"dequantize")
    for spec in t.values():
        ckpt.check(*spec)
    gu, gs = ckpt.view(t["gate_up_blocks"][0])[expert], ckpt.view(t["gate_up_scales"][0])[expert]   # [2I, G, 16]
    I = cfg.moe_intermediate_size
    w13.fill(0, gu[0::2], gs[0::2])
    w13.fill(I, gu[1::2], gs[1::2])
    w2.fill(0, ckpt.view(t["down_blocks"][0])[expert], ckpt.view(t["down_scales"][0])[expert])
    if release:
        for name, _ in t.values():
            ckpt.release(name, expert)


def expert_biases(cfg: ModelConfig, ckpt: Checkpoint, layer: int, experts: list[int], dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The biases of `experts` (global ids, in this order) of `layer`: b13 [E_local, 2I] (gate, then up, as
    w13's rows) and b2 [E_local, H]; None for architectures without them."""
    specs = expert_bias_tensors(cfg, layer)
    if not specs:
        return None
    gate_up = ckpt.tensor(*specs["gate_up"])[experts]                               # [E_local, 2I] interleaved
    b13 = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1)
    b2 = ckpt.tensor(*specs["down"])[experts]                                       # [E_local, H]
    return b13.to(device, dtype).contiguous(), b2.to(device, dtype).contiguous()


def check_expert(cfg: ModelConfig, ckpt: Checkpoint, layer: int, expert: int) -> None:
    """The tensors of `expert` exist with their shapes (headers only); CheckpointError names the first that
    does not."""
    specs = [*stored_expert_tensors(cfg, layer, expert, ckpt)[1].values(), *expert_bias_tensors(cfg, layer).values()]
    for name, shape in specs:
        if ckpt.check(name, shape).dtype == "F8_E4M3":
            ckpt.check_fp8(name)                          # its block scales too, before the first request


def will_need(cfg: ModelConfig, ckpt: Checkpoint, layer: int, expert: int) -> None:
    """Start reading an expert's bytes from disk in the background (MADV_WILLNEED)."""
    layout, t = stored_expert_tensors(cfg, layer, expert, ckpt)
    for name, _ in t.values():
        ckpt.will_need(name, None if layout == "per_expert" else expert)
