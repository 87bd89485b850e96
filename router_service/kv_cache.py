"""Paged KV cache storage: one flat slot array per layer; the block bookkeeping lives in block_allocator.

Shapes: NL layers, S slots (blocks x block size), C context length, Hkv KV heads, D head dim.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        self.block_size = block_size
        slots = num_blocks * block_size
        self.k = torch.empty(num_layers, slots, kv_heads, head_dim, dtype=dtype, device=device)  # [NL, S, Hkv, D]
        self.v = torch.empty(num_layers, slots, kv_heads, head_dim, dtype=dtype, device=device)  # [NL, S, Hkv, D]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * dtype.itemsize

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, slots, k)   # k, v: [T, Hkv, D]
        self.v[layer].index_copy_(0, slots, v)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [..., C] -> k, v [..., C, Hkv, D]."""
        return self.k[layer][slots], self.v[layer][slots]
