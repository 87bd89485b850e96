"""Block alignment for the grouped GEMM: token-expert pairs sorted by expert, each expert's run padded
to a multiple of BLOCK_M, so every BLOCK_M-row block belongs to one expert. Vectorised numpy on the host: on a
GPU the dozen small ops cost a launch each and syncs (kernels/triton_moe.py), and on the host torch's dispatch
costs 3x numpy's (58 against 21 µs at 8 pairs, one thread of a Xeon). Inside a CUDA graph
(kernels/graph_safe.py) the same alignment in torch ops on the device, over the worst-case number of blocks:
no sync, shapes fixed by T, K and E alone; the blocks past the data name expert -1 and the kernels skip them.

Shapes: T tokens, K experts per token (top-k), E local experts, P = T * K token-expert pairs, P_pad pairs
after each expert's run is padded to a multiple of BLOCK_M, NB_max the most blocks P pairs can need.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Alignment:
    sorted_pair_ids: torch.Tensor   # [P_pad] int32 pair index t*K + k, or num_pairs for padding rows
    block_expert: torch.Tensor      # [P_pad / BLOCK_M] int32 local expert of each block
    num_pairs: int                  # T * K


def moe_align_block_size(local_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """local_ids [T, K] on the host, -1 for pairs that are not computed here -> the alignment, on the host."""
    flat = local_ids.reshape(-1).numpy().astype(np.int64, copy=False)     # [P]
    num_pairs = flat.size
    key = np.where(flat >= 0, flat, num_experts)
    order = np.argsort(key, kind="stable")                               # [P] pairs grouped by expert
    counts = np.bincount(key, minlength=num_experts + 1)[:num_experts]   # [E]
    padded = (counts + block_m - 1) // block_m * block_m                 # [E]
    dst_start = np.cumsum(padded) - padded                               # [E] first row of each expert
    src_start = np.cumsum(counts) - counts                               # [E] first sorted pair of each expert
    n_valid = int(counts.sum())
    out = np.full(int(padded.sum()), num_pairs, dtype=np.int32)          # [P_pad]
    e_sorted = key[order[:n_valid]]                                      # [n_valid]
    out[dst_start[e_sorted] + np.arange(n_valid) - src_start[e_sorted]] = order[:n_valid]
    blocks = np.repeat(np.arange(num_experts, dtype=np.int32), padded // block_m)   # [P_pad / BLOCK_M]
    return Alignment(torch.from_numpy(out), torch.from_numpy(blocks), num_pairs)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M blocks `num_pairs` pairs over `num_experts` experts can fill: each expert with pairs
    rounds up by less than one block, and at most min(E, P) experts have pairs."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


def moe_align_on_device(local_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """`moe_align_block_size` in torch ops where the ids are, with no sync: [NB_max · BLOCK_M] pair ids (the
    rows past the data are padding, num_pairs) and [NB_max] block experts (-1 past the data)."""
    dev = local_ids.device
    flat = local_ids.reshape(-1).long()                                  # [P]
    P, E = flat.numel(), num_experts
    key = torch.where(flat >= 0, flat, E)                                # [P] not here: after every expert
    order = torch.sort(key, stable=True).indices                         # [P] pairs grouped by expert
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, key, torch.ones_like(key))  # [E+1]
    here = torch.arange(E + 1, device=dev) < E                           # [E+1] (no item set: a host copy)
    padded = (counts + block_m - 1) // block_m * block_m * here          # [E+1] the pairs not here take no rows
    dst_start = torch.cumsum(padded, 0) - padded                         # [E+1] first row of each expert
    src_start = torch.cumsum(counts, 0) - counts                         # [E+1] first sorted pair of each expert
    e_sorted = key[order]                                                # [P]
    rows = max_blocks(P, E, block_m) * block_m
    dst = dst_start[e_sorted] + torch.arange(P, device=dev) - src_start[e_sorted]   # [P]
    dst = torch.where(e_sorted < E, dst, rows)                           # not here: to the dropped last row
    out = torch.full((rows + 1,), P, dtype=torch.int32, device=dev)      # [NB_max · BLOCK_M + 1]
    out.scatter_(0, dst, order.to(torch.int32))
    ends = torch.cumsum(padded[:E], 0)                                   # [E] one past each expert's last row
    starts = torch.arange(0, rows, block_m, device=dev)                  # [NB_max] each block's first row
    block = torch.searchsorted(ends, starts, right=True)                 # [NB_max] E past the data
    block = torch.where(block < E, block, -1).to(torch.int32)
    return Alignment(out[:rows], block, P)
