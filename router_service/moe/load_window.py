"""The experts' measured load over the last `--placement-window` steps: tokens routed to each (layer, expert), and
token-expert pairs computed by each worker, for placement from load (EPLB) and for the balance the router
reports. A ring of per-step counts; `close_step` moves it on (once per engine step), and the closed steps' ids are
counted into their rows in one bincount every FOLD_EVERY steps, or when the totals are read.

Shapes: L layers of the model (MoE ones filled), E experts per layer.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

# Steps closed before their ids are counted, at most: one bincount for all of them. Counting each step as it closed
# took ~0.1-0.2 ms of a one-stream step (numpy calls per layer, on caches the lm_head's weights had just flushed).
FOLD_EVERY = 64
FOLD_IDS = 1 << 16       # ... or fewer, once they hold this many ids (large prefills: memory and a burst bounded)


class LoadWindow:
    def __init__(self, num_layers: int, num_experts: int, steps: int) -> None:
        if steps <= 0:
            raise ValueError(f"--placement-window must be positive, got {steps}")
        self.steps = steps
        self.ring = torch.zeros(steps, num_layers, num_experts, dtype=torch.long)     # [S, L, E]
        self.now: list[tuple[int, torch.Tensor]] = []                                # this step's (layer, ids)
        self.folded: torch.Tensor | None = None                                      # [L, E] counted early
        self.pairs: list[dict[str, int]] = [{} for _ in range(steps)]                # per step: worker -> pairs
        self.pairs_now: dict[str, int] = {}
        self.at = 0
        self.filled = 0
        self._closed: list[tuple[int, list[tuple[int, torch.Tensor]], torch.Tensor | None]] = []   # (slot, now,
        self._fold_every = max(1, min(FOLD_EVERY, steps))          # folded): closed steps not yet in the ring
        self._closed_ids = 0                                       # the ids they hold
        self._lock = threading.Lock()

    def routed(self, layer: int, ids: torch.Tensor) -> None:
        """ids [T, K]: one layer's dispatch, each token row's experts (-1 = none). Kept as they are and counted when
        the step closes, in one bincount for every layer (three torch ops a layer were ~60 µs of a one-token
        layer's dispatch). Steps that fail never close: what they leave is counted early past a few hundred."""
        self.now.append((layer, ids))
        if len(self.now) >= 512:
            self.folded = self._counts() if self.folded is None else self.folded + self._counts()
            self.now = []

    def _counts(self, steps: list[list[tuple[int, torch.Tensor]]] | None = None) -> torch.Tensor:
        """[S, L, E] the tokens routed to each (layer, expert) in each of `steps` (each a step's (layer, ids)), or
        [L, E] in `now`: in numpy, one bincount for all (no GIL released, no OpenMP region; the torch ops' boolean
        selection took ~0.4 ms of a 32-stream step in a busy router, this ~20 µs)."""
        L, E = self.ring.shape[1:]
        groups = [self.now] if steps is None else steps
        parts = [(ids.numpy().reshape(-1), layer * E + s * L * E) for s, now in enumerate(groups) for layer, ids in now]
        n = len(groups) * L * E
        if parts:
            flat = np.concatenate([ids.astype(np.int64) + base for ids, base in parts])                  # [P]
            flat[np.concatenate([ids < 0 for ids, _ in parts])] = n                                 # -1: a bin dropped
            counts = torch.from_numpy(np.bincount(flat, minlength=n + 1)[:n].reshape(len(groups), L, E))
        else:
            counts = torch.zeros(len(groups), L, E, dtype=torch.long)
        return counts[0] if steps is None else counts

    def computed(self, worker: str, pairs: int) -> None:
        self.pairs_now[worker] = self.pairs_now.get(worker, 0) + pairs

    def close_step(self) -> None:
        with self._lock:
            self._closed.append((self.at, self.now, self.folded))
            self._closed_ids += sum(ids.numel() for _, ids in self.now)
            self.pairs[self.at] = self.pairs_now
            self.at = (self.at + 1) % self.steps
            self.filled = min(self.filled + 1, self.steps)
            if len(self._closed) >= self._fold_every or self._closed_ids >= FOLD_IDS:
                self._fold()
        self.now, self.folded, self.pairs_now = [], None, {}

    def _fold(self) -> None:
        """Count the closed steps into their rows of the ring (under the lock; at most `steps` of them, so no two
        share a row)."""
        closed, self._closed, self._closed_ids = self._closed, [], 0
        if not closed:
            return
        counts = self._counts([now for _, now, _ in closed])                                   # [S, L, E]
        for (slot, _, folded), row in zip(closed, counts, strict=True):
            self.ring[slot] = row if folded is None else row + folded

    def totals(self) -> torch.Tensor:
        """[L, E] tokens routed to each expert over the window."""
        with self._lock:
            self._fold()
            return self.ring.sum(dim=0)

    def worker_pairs(self, workers: tuple[str, ...]) -> dict[str, int]:
        """Token-expert pairs each of `workers` computed over the window."""
        with self._lock:
            out = dict.fromkeys(workers, 0)
            for step in self.pairs:
                for w, n in step.items():
                    if w in out:
                        out[w] += n
            return out

    def balance(self, workers: tuple[str, ...]) -> float:
        """Mean ÷ max of the pairs computed per worker over the window (1 = even; 1 before any load)."""
        pairs = self.worker_pairs(workers)
        busiest = max(pairs.values(), default=0)
        return sum(pairs.values()) / len(pairs) / busiest if busiest else 1.0

    def reset_pairs(self) -> None:
        """Forget the pairs per worker (after a switch the balance is measured afresh); the routed load stays, for
        the next plan."""
        with self._lock:
            self.pairs = [{} for _ in range(self.steps)]
