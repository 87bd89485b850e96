"""Block alignment for the grouped GEMM: token-expert pairs sorted by expert, each expert's run padded
to a multiple of BLOCK_M, so every BLOCK_M-row block belongs to one expert. Vectorised torch, any device.

Shapes: T tokens, K experts per token (top-k), E local experts, P = T * K token-expert pairs, P_pad pairs
after each expert's run is padded to a multiple of BLOCK_M.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Alignment:
    sorted_pair_ids: torch.Tensor   # [P_pad] int32 pair index t*K + k, or num_pairs for padding rows
    block_expert: torch.Tensor      # [P_pad / BLOCK_M] int32 local expert of each block
    num_pairs: int                  # T * K


def moe_align_block_size(local_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """local_ids [T, K] with -1 for pairs that are not computed here."""
    flat = local_ids.reshape(-1).long()                                  # [P]
    num_pairs = flat.numel()
    key = torch.where(flat >= 0, flat, torch.full_like(flat, num_experts))
    order = torch.argsort(key, stable=True)                              # [P] pairs grouped by expert
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m                 # [E]
    dst_start = torch.cumsum(padded, 0) - padded                         # [E] first row of each expert
    src_start = torch.cumsum(counts, 0) - counts                         # [E] first sorted pair of each expert
    n_valid = int(counts.sum())
    total = int(padded.sum())
    out = torch.full((total,), num_pairs, dtype=torch.int32, device=flat.device)  # [P_pad]
    if n_valid:
        e_sorted = key[order[:n_valid]]                                  # [n_valid]
        rank = torch.arange(n_valid, device=flat.device) - src_start[e_sorted]
        out[dst_start[e_sorted] + rank] = order[:n_valid].to(torch.int32)
    blocks = torch.repeat_interleave(torch.arange(num_experts, device=flat.device, dtype=torch.int32),
                                     padded // block_m)                  # [P_pad / BLOCK_M]
    return Alignment(out, blocks, num_pairs)
