"""Which worker holds which experts, per MoE layer: the router's placement plans (elastic expert parallelism).

Pure Python, no torch, no gRPC: worker addresses and load counts in, `{layer: {worker: experts}}` out.

- `even_plan`: contiguous, balanced ranges (the static `--shard I/N` plan of N workers), each expert on R
  distinct workers; the same in every layer. The router's first plan.
- `sticky_plan`: as balanced, but from the current plan, moving as few experts as possible: a resize while no
  load has been measured.
- `load_plan` (EPLB-style): per layer, the experts placed heaviest first on the least-loaded worker (each
  worker holding about E/W), then `redundant` times the busiest worker's hottest expert (by load per replica)
  given one more replica on the least-loaded worker that lacks it, within each worker's budget
  (`--max-experts`).
- `balance`: mean ÷ max of the workers' expected loads when each expert's load splits evenly over its
  replicas (1 = even), the figure `colibri workers show` and `colibri:expert_balance` report.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from colibri_common.placement import replica_experts

Held = dict[int, dict[str, list[int]]]          # layer -> worker address -> its experts (sorted)


class ResizeFailed(Exception):
    """A placement change did not happen (rolled back, or refused); the message says why and what to fix."""


@dataclass(frozen=True)
class Plan:
    """One placement: its epoch, its workers (in order) and each layer's experts per worker."""

    epoch: int
    workers: tuple[str, ...]
    held: Held

    def of(self, worker: str) -> dict[int, list[int]]:
        """The experts `worker` holds, per layer (empty lists where none)."""
        return {layer: list(per.get(worker, ())) for layer, per in self.held.items()}

    def count(self, worker: str) -> int:
        return sum(len(per.get(worker, ())) for per in self.held.values())

    def covers(self, num_experts: int) -> list[tuple[int, int]]:
        """The (layer, expert) pairs no worker holds (empty: the plan is complete)."""
        out = []
        for layer, per in self.held.items():
            have = set().union(*per.values()) if per else set()
            out += [(layer, e) for e in range(num_experts) if e not in have]
        return out


def union(a: Mapping[int, Sequence[int]], b: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
    """Two per-layer expert sets together (what a worker holds while a switch is under way)."""
    return {layer: sorted(set(a.get(layer, ())) | set(b.get(layer, ()))) for layer in set(a) | set(b)}


def even_plan(num_experts: int, layers: Sequence[int], workers: Sequence[str], replicas: int = 1) -> Held:
    """Contiguous ranges, every expert on `replicas` distinct workers, the same in every layer."""
    if not workers:
        raise ValueError("a plan needs at least one worker")
    if len(workers) > num_experts:
        raise ValueError(f"{len(workers)} workers for {num_experts} experts a layer: every worker needs at least one")
    r = min(replicas, len(workers))
    per = {w: replica_experts(num_experts, i, len(workers), r) for i, w in enumerate(workers)}
    return {layer: dict(per) for layer in layers}


def sticky_plan(old: Held, num_experts: int, layers: Sequence[int], workers: Sequence[str], replicas: int = 1
                ) -> Held:
    """Balanced as `even_plan` (counts differ by at most one, every expert on `replicas` distinct workers) but
    moving as few experts as possible from `old`: each keeps the holders it had among `workers` while they have
    room, and only the rest move (3 -> 4 workers moves about a quarter of the experts, not most)."""
    if not workers:
        raise ValueError("a plan needs at least one worker")
    W, E = len(workers), num_experts
    if W > E:
        raise ValueError(f"{W} workers for {E} experts a layer: every worker needs at least one")
    r = min(replicas, W)
    base, extra = divmod(E * r, W)
    out: Held = {}
    for layer in layers:
        prev = old.get(layer, {})
        had = {w: sorted(prev.get(w, ())) for w in workers}
        order = sorted(workers, key=lambda w: (-len(had[w]), workers.index(w)))    # the +1s where most already are
        target = {w: base + (1 if i < extra else 0) for i, w in enumerate(order)}
        held: dict[str, list[int]] = {w: [] for w in workers}
        holders = [0] * E
        for w in workers:                                      # keep what fits
            for e in had[w]:
                if e < E and len(held[w]) < target[w] and holders[e] < r:
                    held[w].append(e)
                    holders[e] += 1
        for e in range(E):                                     # place the rest where there is room
            while holders[e] < r:
                options = [w for w in workers if e not in held[w] and len(held[w]) < target[w]] or \
                    [w for w in workers if e not in held[w]]
                w = max(options, key=lambda w: (target[w] - len(held[w]), -workers.index(w)))
                held[w].append(e)
                holders[e] += 1
        sizes = [len(es) for es in held.values()]
        if max(sizes) - min(sizes) > 1:                        # replicas painted it into a corner: start afresh
            return even_plan(E, layers, workers, r)
        out[layer] = {w: sorted(es) for w, es in held.items()}
    return out


def load_plan(load: Mapping[int, Sequence[float]], workers: Sequence[str], replicas: int = 1, redundant: int = 0,
              budgets: Mapping[str, int] | None = None) -> Held:
    """Experts placed by their measured load (`load[layer][e]`: tokens routed to expert e), each on `replicas`
    distinct workers, plus one more replica for each of the `redundant` hottest experts per layer; a worker
    holds at most `budgets[worker]` experts a layer (0 or absent: no limit)."""
    if not workers:
        raise ValueError("a plan needs at least one worker")
    budgets = budgets or {}
    out: Held = {}
    for layer, counts in load.items():
        E, W = len(counts), len(workers)
        if W > E:
            raise ValueError(f"{W} workers for {E} experts a layer: every worker needs at least one")
        r = min(replicas, W)
        cap = {w: budgets.get(w) or E for w in workers}
        even = -(-E * r // W)                          # about E·R/W each: memory stays even across workers
        if sum(min(cap[w], even) for w in workers) < E * r:
            raise ValueError(f"the workers' --max-experts ({', '.join(f'{w}: {cap[w]}' for w in workers)}) cannot "
                             f"hold {E} experts x {r} replicas a layer")
        held: dict[str, list[int]] = {w: [] for w in workers}
        busy = {w: 0.0 for w in workers}
        share = [float(c) / r for c in counts]                  # each replica takes an even share of its load
        for e in sorted(range(E), key=lambda e: (-share[e], e)):   # heaviest first (LPT)
            for _ in range(r):
                options = [w for w in workers if e not in held[w] and len(held[w]) < min(cap[w], even)] or \
                    [w for w in workers if e not in held[w] and len(held[w]) < cap[w]]   # the even share is full
                if not options:
                    raise ValueError(f"layer {layer}: no worker can take another replica of expert {e} within its "
                                     f"--max-experts; raise it or add workers")
                w = min(options, key=lambda w: (busy[w], len(held[w]), workers.index(w)))
                held[w].append(e)
                busy[w] += share[e]
        replicas_of = {e: r for e in range(E)}
        for _ in range(redundant):          # the busiest worker's hottest expert gets one more replica
            best = None
            for b in sorted(workers, key=lambda w: -busy[w]):
                for e in sorted(held[b], key=lambda e: -share[e]):
                    options = [w for w in workers if e not in held[w] and len(held[w]) < cap[w]]
                    if share[e] <= 0 or not options:
                        continue
                    w = min(options, key=lambda w: (busy[w], len(held[w]), workers.index(w)))
                    if busy[w] + counts[e] / (replicas_of[e] + 1) < busy[b]:     # only where it lowers the peak
                        best = (e, w)
                        break
                if best is not None:
                    break
            if best is None:                                    # no replica would lower the peak
                break
            e, w = best
            holders = [h for h in workers if e in held[h]]
            after = counts[e] / (replicas_of[e] + 1)
            for h in holders:                                   # its holders shed a share of it
                busy[h] -= share[e] - after
            held[w].append(e)
            busy[w] += after
            replicas_of[e] += 1
            share[e] = after
        out[layer] = {w: sorted(es) for w, es in held.items()}
    return out


def balance(held: Held, load: Mapping[int, Sequence[float]]) -> float:
    """Mean ÷ max of the workers' expected token-expert pairs over every layer, each expert's load split
    evenly over its holders (1.0 = even; 1.0 as well with no load measured)."""
    busy: dict[str, float] = {}
    for layer, per in held.items():
        counts = load.get(layer)
        if counts is None:
            continue
        holders: dict[int, list[str]] = {}
        for w, es in per.items():
            busy.setdefault(w, 0.0)
            for e in es:
                holders.setdefault(e, []).append(w)
        for e, ws in holders.items():
            for w in ws:
                busy[w] += counts[e] / len(ws)
    if not busy or max(busy.values()) <= 0:
        return 1.0
    return sum(busy.values()) / len(busy) / max(busy.values())
