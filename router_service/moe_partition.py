"""MoE stage 2 of 4, partition (route → **partition** → transport → combine): which token rows go to which
worker. Pure: tensors in, row sets out; no gRPC, testable on its own.

Shapes: T tokens in the step, K experts per token (top-k), E experts per layer, W workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class WorkerRows:
    """The token rows one worker computes for one MoE layer."""

    worker: int
    rows: torch.Tensor | None      # [n] token rows, ascending; None = every row of the step (n == T)


def partition(owner: torch.Tensor, topk_ids: torch.Tensor, num_workers: int) -> list[WorkerRows]:
    """owner [E] expert -> worker, topk_ids [T, K] -> one WorkerRows per worker with at least one token.

    A token goes to every worker that holds one of its K experts (once, whatever how many of them it holds);
    the worker computes the weighted sum over the experts it holds. Workers without tokens are left out.
    """
    T = topk_ids.shape[0]
    if T == 0:
        return []
    if num_workers == 1:
        return [WorkerRows(0, None)]
    hits = F.one_hot(owner[topk_ids], num_workers).any(dim=1)                # [T, W] token needs worker w
    counts = hits.sum(dim=0).tolist()                                        # [W], one sync for all workers
    out = []
    for w, n in enumerate(counts):
        if n == T:
            out.append(WorkerRows(w, None))
        elif n:
            out.append(WorkerRows(w, hits[:, w].nonzero().flatten()))       # [n]
    return out
