"""A worker's shapes and sizes from the model's config and its flags: the expert matrices the CPU forms are measured
for, a shard's fused-MoE shape, one packed expert's bytes, and the expert cache's tiers (`--expert-cache-capacity`,
`--expert-cache-host-capacity`). Used by the worker at start and by `colibri tune`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from colibri_common.config import ModelConfig
from colibri_common.placement import replica_experts
from expert_service.cache_capacity import CacheCapacity, parse_capacity
from expert_service.kept_format import Kept
from kernels import QUANTIZE_MODES, MoeShape


def expert_linear_shapes(cfg: ModelConfig, kind_: str) -> list[tuple[int, int, str]]:
    """(Dout, Din, kind) of each expert's two matrices, gate/up [2I, H] and down [H, I]: the shapes the CPU
    forms are measured for (by a worker at start-up and by `colibri tune`)."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    return [(2 * I, H, kind_), (H, I, kind_)]


def expert_moe_shape(cfg: ModelConfig, num_shards: int, kind_: str, replicas: int = 1,
                     slots: int | None = None, local: int | None = None) -> MoeShape:
    """The fused-MoE shape of one shard of `num_shards` (its form, loop or grouped, is measured for it), or of
    `local` experts a layer (a plan of the router's); with an expert cache the kernel runs over its `slots`."""
    if local is None:
        local = len(replica_experts(cfg.num_experts, 0, num_shards, replicas))
    pairs = max(1, min(local, round(cfg.top_k * local / cfg.num_experts)))
    return MoeShape(slots or local, cfg.moe_intermediate_size, cfg.hidden_size, min(pairs, slots or local), kind_)


def packed_expert_bytes(cfg: ModelConfig, dtype: torch.dtype, quantize: str | None, kept: Kept | None = None
                        ) -> int:
    """One expert's gate/up/down, packed: int8 values and a float32 scale per row, the checkpoint's FP8 or
    MXFP4 values and scales, or the compute dtype."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    if quantize in QUANTIZE_MODES:
        return 3 * H * I + (2 * I + H) * 4
    if kept is not None:
        return kept.expert_bytes(cfg)
    return 3 * H * I * dtype.itemsize


@dataclass(frozen=True)
class CacheSetting:
    """The hot tier's slots and policy; `warm` is the pinned host tier of a GPU worker (None = off)."""

    capacity: CacheCapacity
    policy: str = "lru"
    half_life: float = 256.0
    warm: CacheCapacity | None = None


def cache_setting(cfg: ModelConfig, num_local: int, dtype: torch.dtype, quantize: str | None, capacity: str,
                  policy: str = "lru", half_life: float = 256.0, host_capacity: str = "off",
                  kept: Kept | None = None) -> CacheSetting | None:
    """The cache a worker holding `num_local` experts per layer gets from its flags; None = all hot."""
    each = packed_expert_bytes(cfg, dtype, quantize, kept)
    hot = parse_capacity(capacity, num_local, len(cfg.moe_layers), each)
    if not hot.bounded:
        return None
    warm = None if host_capacity == "off" else parse_capacity(host_capacity, num_local, len(cfg.moe_layers), each,
                                                              "--expert-cache-host-capacity")
    if warm is not None and not warm.bounded:                    # all of the shard in pinned host memory
        warm = CacheCapacity(num_local, per_layer=True)
    return CacheSetting(hot, policy, half_life, warm)
