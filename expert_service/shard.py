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
from colibri_common.placement import shard_experts
from colibri_common.tensors import expert_tensors, fused_expert_tensors
from kernels import fused_moe

log = logging.getLogger("colibri.expert")


class ExpertShard:
    def __init__(self, cfg: ModelConfig, ckpt: Checkpoint, shard: int, num_shards: int, dtype: torch.dtype,
                 progress: bool = False) -> None:
        self.cfg = cfg
        self.shard, self.num_shards = shard, num_shards
        self.dtype = dtype
        self.experts = shard_experts(cfg.num_experts, shard, num_shards)
        self.expert_map = torch.full((cfg.num_experts,), -1, dtype=torch.long)  # [E] global -> local
        self.expert_map[self.experts] = torch.arange(len(self.experts))
        self.w13: dict[int, torch.Tensor] = {}
        self.w2: dict[int, torch.Tensor] = {}
        for layer in tqdm(cfg.moe_layers, desc=f"experts {shard}/{num_shards}", unit="layer",
                          disable=not progress):
            self.w13[layer], self.w2[layer] = self._pack(ckpt, layer)

    def _pack(self, ckpt: Checkpoint, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        E, H, I = len(self.experts), cfg.hidden_size, cfg.moe_intermediate_size
        w13 = torch.empty(E, 2 * I, H, dtype=self.dtype)                     # [E_local, 2I, H]
        w2 = torch.empty(E, H, I, dtype=self.dtype)                          # [E_local, H, I]
        fused = fused_expert_tensors(cfg, layer)
        if fused["gate_up"][0] in ckpt:
            (gu_name, gu_shape), (d_name, d_shape) = fused["gate_up"], fused["down"]
            lo, hi = self.experts[0], self.experts[-1] + 1                   # contiguous by placement
            w13.copy_(ckpt.view(gu_name, gu_shape)[lo:hi])
            w2.copy_(ckpt.view(d_name, d_shape)[lo:hi])
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

    def linear_shapes(self) -> list[tuple[int, int, torch.dtype]]:
        """(Dout, Din, dtype) of each expert's two matrices: gate/up [2I, H] and down [H, I]."""
        H, I = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        return [(2 * I, H, self.dtype), (H, I, self.dtype)]

    @property
    def packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.w13.values(), *self.w2.values()))

    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        """hidden [n, H], ids [n, K] global ids (others' experts ignored), weights [n, K] -> [n, H]."""
        if layer not in self.w13:
            raise KeyError(f"layer {layer} has no routed experts (MoE layers: {list(self.cfg.moe_layers)})")
        x = hidden if hidden.dtype == self.dtype else hidden.to(self.dtype)
        return fused_moe(x, self.w13[layer], self.w2[layer], ids, weights, self.expert_map)
