"""Batch invariance in attention: each query's exact context, so its attention is computed alone.

A batched SDPA call's result for one query depends on the call's shape: the padding of a decode batch to its
longest context, the chunk a prefill query shares with others (measured: both change float32 outputs in
the last bits, bf16 ones by up to 2^-10). Under `--batch-invariant` the attention runs one query at a time over
exactly the keys it sees (its cached context, or its window's part on a sliding layer), laid out the same
way whether the query is a decode token or part of a prefill chunk, so the result is a function of the
query and its context alone.

Shapes: T tokens of the step, Bd decode sequences, C one query's context.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from router_service.model.step_inputs import StepInputs


def _span(mask_row: torch.Tensor) -> tuple[int, int]:
    """[a, b) of the True entries of a mask row (they are contiguous: causal, or a sliding window)."""
    idx = mask_row.nonzero().flatten()
    a, b = int(idx[0]), int(idx[-1]) + 1
    assert b - a == idx.numel(), "a query's visible keys must be contiguous"
    return a, b


def query_contexts(step: StepInputs, sliding: bool) -> Iterator[tuple[int, torch.Tensor]]:
    """(row of the step, KV slots [C] that query attends to, in position order) for every row."""
    if step.num_decode:
        slots, mask = (step.decode_window_slots, step.decode_window_mask) if sliding else \
            (step.decode_slots, step.decode_mask)                            # [Bd, C], [Bd, 1, 1, C]
        for i in range(step.num_decode):
            a, b = _span(mask[i, 0, 0])
            yield i, slots[i, a:b]
    for j, (row, n, ctx_slots, mask) in enumerate(step.prefills):
        if sliding:
            lo, mask = step.prefill_windows[j]                               # mask [n, ctx - lo]
            ctx_slots = ctx_slots[lo:]
        cached = ctx_slots.shape[0] - n
        for q in range(n):
            if mask is None:                                                 # causal: positions 0..q
                yield row + q, ctx_slots[:cached + q + 1]
            else:
                a, b = _span(mask[q])
                yield row + q, ctx_slots[a:b]
