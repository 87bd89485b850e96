"""Pack one expert from the checkpoint's mapped bytes into compute-ready storage, in any layout on disk.

The published layouts: one tensor per expert and projection (`experts.{e}.gate_proj.weight`, …), or the
experts of a layer fused (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]). Packing
converts to the storage's dtype (or quantises to int8) as it copies, then drops the mapped pages it read,
so reading an expert costs its packed size in memory and nothing more.

Shapes: H hidden size, I expert width, E experts per layer.
"""

from __future__ import annotations

from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.tensors import stored_expert_tensors
from kernels.cpu_forms import Weight


def pack_expert(cfg: ModelConfig, ckpt: Checkpoint, layer: int, expert: int, w13: Weight, w2: Weight,
                release: bool = True) -> None:
    """Global `expert` of `layer` into w13 [2I, H] (gate rows, then up rows) and w2 [H, I]."""
    I = cfg.moe_intermediate_size
    fused, t = stored_expert_tensors(cfg, layer, expert, ckpt)
    if fused:
        (gu_name, gu_shape), (d_name, d_shape) = t["gate_up"], t["down"]
        w13.copy_(ckpt.tensor(gu_name, gu_shape, expert))
        w2.copy_(ckpt.tensor(d_name, d_shape, expert))
        if release:
            ckpt.release(gu_name, expert)
            ckpt.release(d_name, expert)
        return
    (g, gs), (u, us), (d, ds) = t["gate"], t["up"], t["down"]
    w13[:I].copy_(ckpt.tensor(g, gs))
    w13[I:].copy_(ckpt.tensor(u, us))
    w2.copy_(ckpt.tensor(d, ds))
    if release:
        for name in (g, u, d):
            ckpt.release(name)


def check_expert(cfg: ModelConfig, ckpt: Checkpoint, layer: int, expert: int) -> None:
    """The tensors of `expert` exist with their shapes (headers only); CheckpointError names the first that
    does not."""
    for name, shape in stored_expert_tensors(cfg, layer, expert, ckpt)[1].values():
        if ckpt.check(name, shape).dtype == "F8_E4M3":
            ckpt.check_fp8(name)                          # its block scales too, before the first request


def will_need(cfg: ModelConfig, ckpt: Checkpoint, layer: int, expert: int) -> None:
    """Start reading an expert's bytes from disk in the background (MADV_WILLNEED)."""
    fused, t = stored_expert_tensors(cfg, layer, expert, ckpt)
    for name, _ in t.values():
        ckpt.will_need(name, expert if fused else None)
