"""MoE stage 2 of 4, partition (route → **partition** → transport → combine): which token rows go to which
worker. Pure: tensors in, row sets out; no gRPC, testable on its own.

Shapes: T tokens in the step, K experts per token (top-k), E experts per layer, W workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class WorkerRows:
    """The token rows one worker computes for one MoE layer."""

    worker: int
    rows: torch.Tensor | None      # [n] token rows, ascending; None = every row of the step (n == T)
    pairs: int                     # the token-expert pairs among them whose expert this worker holds


SMALL = 8     # token rows up to which partition works in Python (a bench-fleet layer at one row: 44 -> 24 µs)


def partition(owner: torch.Tensor | Sequence[int], topk_ids: torch.Tensor, num_workers: int) -> list[WorkerRows]:
    """owner [E] expert -> worker (a tensor, or a list as `Table.owner_lists` keeps it), topk_ids [T, K] -> one
    WorkerRows per worker with at least one token.

    A token goes to every worker that holds one of its K experts (once, whatever how many of them it holds);
    the worker computes the weighted sum over the experts it holds. Workers without tokens are left out.
    """
    T = topk_ids.shape[0]
    if T == 0:
        return []
    if num_workers == 1:
        return [WorkerRows(0, None, topk_ids.numel())]
    if T <= SMALL:                 # a decode step of a few streams: one sync and Python lists, not five torch ops
        # a list owner spares the torch ops (each ~50 µs on the caches the attention's weights just flushed)
        own = owner.tolist() if isinstance(owner, torch.Tensor) else owner   # [E]
        owners = [[own[e] for e in row] for row in topk_ids.tolist()]       # [T][K] each pair's worker
        out = []
        for w in range(num_workers):
            per_row = [r.count(w) for r in owners]                           # [T] pairs of each row here
            rows = [t for t, n in enumerate(per_row) if n]
            if len(rows) == T:
                out.append(WorkerRows(w, None, sum(per_row)))
            elif rows:
                out.append(WorkerRows(w, torch.tensor(rows, dtype=torch.long), sum(per_row)))
        return out
    # numpy, not torch: each torch op lets go of the GIL, which the stream handlers then hold while the engine waits
    # for it back (at 32 streams this took 187 µs a layer, against 14 at one)
    own = owner.numpy() if isinstance(owner, torch.Tensor) else np.asarray(owner)     # [E]
    owners = own[topk_ids.numpy()]                                                     # [T, K] each pair's worker
    out = []
    for w in range(num_workers):
        per_row = (owners == w).sum(axis=1)                                            # [T] pairs of each row here
        rows = np.flatnonzero(per_row)                                                 # [n]
        if rows.size == T:
            out.append(WorkerRows(w, None, int(per_row.sum())))
        elif rows.size:
            out.append(WorkerRows(w, torch.from_numpy(rows.astype(np.int64)), int(per_row.sum())))
    return out


@dataclass(frozen=True)
class WorkerPairs:
    """The token-expert pairs one worker computes for one MoE layer (replicated placement)."""

    worker: int
    rows: torch.Tensor | None      # [n] token rows with at least one pair here, ascending; None = every row (n == T)
    ids: torch.Tensor              # [n, K] the rows' expert ids, -1 where another worker computes the pair
    pairs: int                     # the pairs here (ids >= 0)


@dataclass(frozen=True)
class Placement:
    """A layer's pairs on live holders (`place`): one message per worker with pairs, and what fails."""

    parts: list[WorkerPairs]
    unplaced: list[int]                        # token rows with a pair that no live worker holds
    assigned: torch.Tensor | list[list[int]]   # [T, K] each pair's worker (-1: not placed), as `assign` gives


def assign(holders: torch.Tensor, topk_ids: torch.Tensor, live: list[bool],
           pairs: torch.Tensor | None = None, holding: Sequence[Sequence[int]] | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's worker: one live holder of its expert, least-loaded first (experts with one live holder are
    placed first, then those with the most pairs, each on the live holder with the fewest pairs so far). A hot
    expert (more pairs than half a worker's fair share) with several live holders has its pairs split over them,
    filling the least-loaded first (water-filling), so a redundant replica takes load within one step.

    holders [E, W] bool, topk_ids [T, K], live [W] (entries past W are not read); `pairs` [T, K] bool limits the
    pairs placed (default all); `holding` must be `holding_of(holders)` (E -> its workers, ascending, as
    `Table.holding` keeps them), given so that no tensor is read per layer.
    Returns (worker [T, K] int64, -1 where not placed or no live holder; unplaced [T] bool: rows with a pair
    that no live worker holds).

    Up to SMALL rows the pairs are placed in Python lists from one copy of the ids (the tensor way's masked
    selections and gathers each started an OpenMP region, ~1 ms while the workers hold the cores; with `place`,
    one row of 4 experts on 4 workers takes 28 µs on an idle CPU against 94 before, `python -m
    benchmarks.placement`); beyond, in numpy arrays (no torch op). Both ways place every pair the same
    (tests/test_placement_plan.py compares them)."""
    T, K = topk_ids.shape
    live = live[:holders.shape[1]]
    assert len(live) == holders.shape[1], "a worker of the holders has no liveness"
    if holding is None:
        holding = holding_of(holders)
    if T <= SMALL:
        worker_l, unplaced_l = _assign_lists(holding, topk_ids.tolist(), live,
                                             None if pairs is None else pairs.tolist())
        return (torch.tensor(worker_l, dtype=torch.long).reshape(T, K),
                torch.tensor(unplaced_l, dtype=torch.bool).reshape(T))
    return _assign_arrays(holding, topk_ids, live, pairs)


def place(holders: torch.Tensor, topk_ids: torch.Tensor, live: list[bool], pairs: torch.Tensor | None = None,
          holding: Sequence[Sequence[int]] | None = None) -> Placement:
    """`assign` then `split_pairs` (the same arguments as `assign`), without the tensors a dispatch does not read:
    up to SMALL rows the worker of each pair stays a list (a failover makes a tensor of it), and the rows no live
    worker holds are listed."""
    T, K = topk_ids.shape
    W = holders.shape[1]
    live = live[:W]
    assert len(live) == W, "a worker of the holders has no liveness"
    if holding is None:
        holding = holding_of(holders)
    if T <= SMALL:
        ids = topk_ids.tolist()
        worker, unplaced = _assign_lists(holding, ids, live, None if pairs is None else pairs.tolist())
        return Placement(_split_lists(worker, ids, W), [t for t, u in enumerate(unplaced) if u], worker)
    worker_t, unplaced_t = _assign_arrays(holding, topk_ids, live, pairs)
    missing = np.flatnonzero(unplaced_t.numpy()).tolist()                      # (numpy: no torch op, as above)
    return Placement(_split_arrays(worker_t, topk_ids, W), missing, worker_t)


def holding_of(holders: torch.Tensor) -> list[tuple[int, ...]]:
    """holders [E, W] bool -> each expert's workers, ascending."""
    return [tuple(w for w, h in enumerate(row) if h) for row in holders.tolist()]


def _choose(holding: Sequence[Sequence[int]], counts: list[int], live: list[bool]
            ) -> tuple[list[int], list[tuple[int, list[tuple[int, int]]]]]:
    """Both ways' placement from each expert's pair count (live [W], one entry per worker of the holders):
    (choice [E]: the worker of each expert's pairs, -1 for none or split; splits: (expert, [(worker, pairs)]) for
    hot experts spread over several holders)."""
    E, W = len(holding), len(live)
    up = [w for w in range(W) if live[w]]
    used = [e for e in range(E) if counts[e]]
    if len(up) == W:            # every worker live: an expert's holders are its holders below W (most often all)
        holders_of = {e: h if not h or h[-1] < W else tuple(w for w in h if w < W)
                      for e in used for h in (holding[e],)}                    # ascending
    else:
        holders_of = {e: tuple(w for w in holding[e] if w < W and live[w]) for e in used}   # live holders, ascending
    load = [0] * W
    choice = [-1] * E
    hot = max(2, sum(counts) // (2 * max(1, len(up))))                          # half a worker's fair share
    splits: list[tuple[int, list[tuple[int, int]]]] = []                       # (expert, [(worker, pairs)])
    # experts with one holder first (they have no choice), then the most pairs first
    for e in sorted(used, key=lambda e: (len(holders_of[e]) > 1, -counts[e])):
        options = holders_of[e]
        if len(options) > 1 and counts[e] >= hot:
            shares = water_fill(counts[e], [load[w] for w in options])
            splits.append((e, [(w, n) for w, n in zip(options, shares, strict=True) if n]))
            for w, n in zip(options, shares, strict=True):
                load[w] += n
        elif options:
            if len(options) == 1:
                w = options[0]
            elif len(options) == 2:                                            # the least loaded, the lower on a tie
                w = options[0] if load[options[0]] <= load[options[1]] else options[1]
            else:
                w = min(options, key=lambda w: (load[w], w))
            choice[e] = w
            load[w] += counts[e]
    return choice, splits


def _assign_lists(holding: Sequence[Sequence[int]], ids: list[list[int]], live: list[bool],
                  pairs: list[list[bool]] | None) -> tuple[list[list[int]], list[bool]]:
    """`assign` on Python lists: ids [T][K], pairs [T][K] -> (worker [T][K], unplaced [T])."""
    E = len(holding)
    todo = [[e >= 0 and (pairs is None or pairs[t][k]) for k, e in enumerate(row)] for t, row in enumerate(ids)]
    counts = [0] * E
    for row, do in zip(ids, todo, strict=True):
        for e, d in zip(row, do, strict=True):
            if d:
                counts[e] += 1
    choice, splits = _choose(holding, counts, live)
    worker = [[choice[e] if d else -1 for e, d in zip(row, do, strict=True)] for row, do in zip(ids, todo, strict=True)]
    for e, parts in splits:                                                    # consecutive runs of e's pairs
        at = [(t, k) for t, (row, do) in enumerate(zip(ids, todo, strict=True))
              for k, (f, d) in enumerate(zip(row, do, strict=True)) if d and f == e]    # in (t, k) order
        start = 0
        for w, n in parts:
            for t, k in at[start:start + n]:
                worker[t][k] = w
            start += n
    unplaced = [any(d and w < 0 for w, d in zip(wr, do, strict=True)) for wr, do in zip(worker, todo, strict=True)]
    return worker, unplaced


def _assign_arrays(holding: Sequence[Sequence[int]], topk_ids: torch.Tensor, live: list[bool],
                    pairs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`assign` for many rows, in numpy: no torch op, each of which lets go of the GIL that the stream handlers
    then hold (at 32 rows the tensor form took ~0.4 ms a layer), nor starts an OpenMP region (see `assign`)."""
    E = len(holding)
    ids = topk_ids.numpy().astype(np.int64)                                    # [T, K]
    todo = (ids >= 0) if pairs is None else pairs.numpy() & (ids >= 0)         # [T, K]
    counts = np.bincount(np.where(todo, ids, E).ravel(), minlength=E + 1)[:E].tolist()   # [E]
    choice, splits = _choose(holding, counts, live)
    worker = np.where(todo, np.asarray(choice, dtype=np.int64)[np.clip(ids, 0, None)], -1)   # [T, K]
    flat = worker.reshape(-1)
    for e, parts in splits:                                                    # consecutive runs of e's pairs
        at = np.flatnonzero(todo & (ids == e))                                 # [counts[e]] in (t, k) order
        start = 0
        for w, n in parts:
            flat[at[start:start + n]] = w
            start += n
    unplaced = (todo & (worker < 0)).any(axis=1)                               # [T]
    return torch.from_numpy(worker), torch.from_numpy(unplaced)


def water_fill(n: int, loads: list[int]) -> list[int]:
    """n pairs over holders with these loads, each next pair to the least loaded: the counts each gets."""
    order = sorted(range(len(loads)), key=lambda i: (loads[i], i))
    out = [0] * len(loads)
    level, left = loads[order[0]], n
    k = 1
    while left:
        nxt = loads[order[k]] if k < len(order) else None                      # raise the k lowest to the next
        room = (nxt - level) * k if nxt is not None else left
        if room >= left or nxt is None:
            each, extra = divmod(left, k)
            for j, i in enumerate(order[:k]):
                out[i] += level - loads[i] + each + (1 if j < extra else 0)
            return out
        left -= room
        level = nxt
        k += 1
    return out


def split_pairs(worker: torch.Tensor, topk_ids: torch.Tensor, num_workers: int) -> list[WorkerPairs]:
    """One WorkerPairs per worker with at least one pair (worker [T, K] from `assign`); up to SMALL rows in Python
    lists, as `assign`."""
    if worker.shape[0] <= SMALL:
        return _split_lists(worker.tolist(), topk_ids.tolist(), num_workers)
    return _split_arrays(worker, topk_ids, num_workers)


def _split_lists(worker: list[list[int]], ids: list[list[int]], num_workers: int) -> list[WorkerPairs]:
    """`split_pairs` on Python lists: worker [T][K], ids [T][K]."""
    out = []
    K = len(ids[0]) if ids else 0
    for w in range(num_workers):
        rows = [t for t, row in enumerate(worker) if w in row]
        if rows:
            mine = [[e if o == w else -1 for e, o in zip(ids[t], worker[t], strict=True)] for t in rows]
            # numpy, then wrapped: no torch op (each is tens of µs on the caches the attention's weights flushed)
            out.append(WorkerPairs(w, None if len(rows) == len(worker) else torch.from_numpy(np.array(rows, np.int64)),
                                   torch.from_numpy(np.array(mine, np.int32).reshape(len(rows), K)),
                                   sum(row.count(w) for row in worker)))
    return out


def _split_arrays(worker: torch.Tensor, topk_ids: torch.Tensor, num_workers: int) -> list[WorkerPairs]:
    """`split_pairs` for many rows (worker [T, K] >= -1, as `assign` gives), in numpy as `_assign_arrays`."""
    out = []
    own = worker.numpy()                                                       # [T, K]
    ids32 = topk_ids.numpy().astype(np.int32)                                  # [T, K]
    present = np.bincount(own.ravel() + 1, minlength=num_workers + 1)[1:].tolist()   # [W] pairs each
    for w in range(num_workers):
        if not present[w]:
            continue
        mine = own == w                                                        # [T, K]
        rows = np.flatnonzero(mine.any(axis=1))                                # [n]
        if rows.size == own.shape[0]:
            out.append(WorkerPairs(w, None, torch.from_numpy(np.where(mine, ids32, -1).astype(np.int32)),
                                   present[w]))                                # every row
            continue
        ids = np.where(mine[rows], ids32[rows], -1).astype(np.int32)           # [n, K]
        out.append(WorkerPairs(w, torch.from_numpy(rows.astype(np.int64)), torch.from_numpy(ids), present[w]))
    return out
