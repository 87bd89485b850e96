"""A worker's experts: mapped from the checkpoint, packed into contiguous per-layer buffers.

Mapped: every safetensors file is mmap'd; only the byte ranges of this shard's experts are ever read.
Packed: for each MoE layer, w13 [E_local, 2I, H] (gate rows, then up rows) and w2 [E_local, H, I] in the
compute dtype, in anonymous memory. After packing the mappings are released, so the worker's resident
memory is its shard, not the model.

Shapes: E_local experts held here, H hidden size, I expert width, n tokens of a call, K experts per token.
"""

from __future__ import annotations

import logging

import torch
from tqdm import tqdm

from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.placement import replica_experts
from colibri_common.tensors import expert_tensors, fused_expert_tensors
from kernels import fused_moe
from kernels.cpu_forms import Weight, weight_kind
from kernels.cpu_tune import MoeShape
from kernels.quant import Int8Weight

log = logging.getLogger("colibri.expert")


def expert_linear_shapes(cfg: ModelConfig, kind_: str) -> list[tuple[int, int, str]]:
    """(Dout, Din, kind) of each expert's two matrices, gate/up [2I, H] and down [H, I]: the shapes the CPU
    forms are measured for (by a worker at start-up and by `colibri tune`)."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    return [(2 * I, H, kind_), (H, I, kind_)]


def expert_moe_shape(cfg: ModelConfig, num_shards: int, kind_: str, replicas: int = 1) -> MoeShape:
    """The fused-MoE shape of one shard of `num_shards` (its form, loop or grouped, is measured for it)."""
    local = len(replica_experts(cfg.num_experts, 0, num_shards, replicas))
    pairs = max(1, min(local, round(cfg.top_k * local / cfg.num_experts)))
    return MoeShape(local, cfg.moe_intermediate_size, cfg.hidden_size, pairs, kind_)


class ExpertShard:
    """`dtype` is the compute dtype of the activations; the weights are packed in it, or as int8 with a
    float32 scale per output row when `quantize == "int8"` (quantised expert by expert as they are read)."""

    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint, shard: int, num_shards: int, dtype: torch.dtype,
                 progress: bool = False, quantize: str | None = None, device: torch.device | None = None,
                 replicas: int = 1) -> None:
        if quantize not in (None, "int8"):
            raise ValueError(f"quantize '{quantize}' is unknown; use int8 or none")
        self.device = device or torch.device("cpu")
        if quantize == "int8" and self.device.type != "cpu":
            raise ValueError("int8 experts are computed by the CPU kernels; on a GPU pack them in bf16")
        self.cfg = cfg
        self.shard, self.num_shards = shard, num_shards
        self.dtype, self.quantize = dtype, quantize
        self.experts = replica_experts(cfg.num_experts, shard, num_shards, replicas)
        self.replicas = replicas
        expert_map = torch.full((cfg.num_experts,), -1, dtype=torch.long)       # [E] global -> local
        expert_map[self.experts] = torch.arange(len(self.experts))
        self.expert_map = expert_map.to(self.device)
        self.w13: dict[int, Weight] = {}
        self.w2: dict[int, Weight] = {}
        for layer in tqdm(cfg.moe_layers, desc=f"experts {shard}/{num_shards}", unit="layer",
                          disable=not progress):
            self.w13[layer], self.w2[layer] = self._pack(ckpt, layer)

    def _empty(self, *shape: int) -> Weight:
        if self.quantize == "int8":
            return Int8Weight.empty(*shape)
        return torch.empty(shape, dtype=self.dtype, device=self.device)     # filled expert by expert

    def _pack(self, ckpt: Checkpoint, layer: int) -> tuple[Weight, Weight]:
        cfg = self.cfg
        E, H, I = len(self.experts), cfg.hidden_size, cfg.moe_intermediate_size
        w13 = self._empty(E, 2 * I, H)                                       # [E_local, 2I, H]
        w2 = self._empty(E, H, I)                                            # [E_local, H, I]
        fused = fused_expert_tensors(cfg, layer)
        if fused["gate_up"][0] in ckpt:
            (gu_name, gu_shape), (d_name, d_shape) = fused["gate_up"], fused["down"]
            gate_up, down = ckpt.view(gu_name, gu_shape), ckpt.view(d_name, d_shape)
            for j, e in enumerate(self.experts):                             # one expert at a time: no float
                w13[j].copy_(gate_up[e])                                     # copy of the shard when quantising
                w2[j].copy_(down[e])
            ckpt.release(gu_name)
            ckpt.release(d_name)
            return w13, w2
        for j, e in enumerate(self.experts):
            t = expert_tensors(cfg, layer, e)
            (g, gs), (u, us), (d, ds) = t["gate"], t["up"], t["down"]
            w13[j, :I].copy_(ckpt.view(g, gs))
            w13[j, I:].copy_(ckpt.view(u, us))
            w2[j].copy_(ckpt.view(d, ds))
            for name in (g, u, d):
                ckpt.release(name)
        return w13, w2

    def linear_shapes(self) -> list[tuple[int, int, str]]:
        return expert_linear_shapes(self.cfg, weight_kind(self.quantize == "int8", self.dtype))

    def moe_shape(self) -> MoeShape:
        return expert_moe_shape(self.cfg, self.num_shards, weight_kind(self.quantize == "int8", self.dtype),
                                self.replicas)

    @property
    def weight_dtype(self) -> str:
        return "int8" if self.quantize == "int8" else str(self.dtype).removeprefix("torch.")

    @property
    def packed_bytes(self) -> int:
        return sum(w.nbytes for w in (*self.w13.values(), *self.w2.values()))

    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """hidden [n, H], ids [n, K] global ids (others' experts ignored), weights [n, K] -> [n, H]."""
        if layer not in self.w13:
            raise KeyError(f"layer {layer} has no routed experts (MoE layers: {list(self.cfg.moe_layers)})")
        x = hidden.to(self.device, self.dtype)                                             # [n, H]
        ids, weights = ids.to(self.device), weights.to(self.device)                       # [n, K]
        return fused_moe(x, self.w13[layer], self.w2[layer], ids, weights, self.expert_map)   # [n, H] on device
