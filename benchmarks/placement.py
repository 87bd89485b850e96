"""The router's per-layer placement of a MoE layer's pairs, on one thread, without workers: the single-holder
path of a static `--shard` fleet (`partition`: which token rows each worker gets) against the explicit path of
replicas and router-planned fleets (`place`: each token-expert pair to one live holder, least-loaded first, hot
experts split over their replicas, then a message per worker). Both run on every MoE layer of every step, so their
cost is part of the router's `dispatch` phase.

    python -m benchmarks.placement [--experts 32] [--workers 4] [--replicas 2] [--top-k 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import finish, machine, publish, table
from colibri_common.placement import replica_experts, shard_experts
from router_service.moe.partition import holding_of, partition, place


def timed(call, rounds: int = 5, n: int = 400) -> float:
    """The median over `rounds` of the mean µs of `n` calls (after 50 unmeasured)."""
    for _ in range(50):
        call()
    means = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            call()
        means.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(means)


def explicit(holders: torch.Tensor, holding: list[tuple[int, ...]], ids: torch.Tensor, live: list[bool]) -> None:
    """What a dispatch of replicated experts does before its sends."""
    if place(holders, ids, live, holding=holding).unplaced:
        raise AssertionError("every expert has a live holder here")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=32, help="experts per layer (default: %(default)s)")
    ap.add_argument("--workers", type=int, default=4, help="workers (default: %(default)s)")
    ap.add_argument("--replicas", type=int, default=2, help="holders of each expert, explicit path "
                    "(default: %(default)s)")
    ap.add_argument("--top-k", type=int, default=4, help="experts per token (default: %(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    E, W, R, K = args.experts, args.workers, args.replicas, args.top_k
    if not 1 <= R <= W or K > E:
        raise SystemExit("need 1 <= --replicas <= --workers and --top-k <= --experts")
    holders = torch.zeros(E, W, dtype=torch.bool)                                      # [E, W]
    owner = torch.full((E,), -1, dtype=torch.long)                                     # [E]
    for w in range(W):
        holders[replica_experts(E, w, W, R), w] = True
        owner[shard_experts(E, w, W)] = w
    holding, live = holding_of(holders), [True] * W
    g = torch.Generator().manual_seed(0)
    rows = []
    for T in (1, 8, 32):
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)   # [T, K]

        rows.append([str(T), f"{timed(lambda ids=ids: partition(owner, ids, W)):.0f}",
                     f"{timed(lambda ids=ids: explicit(holders, holding, ids, live)):.0f}"])
    publish("\n".join([
        "# The router's per-layer placement", "",
        f"Machine: {machine()}.",
        f"Command: `python -m benchmarks.placement --experts {E} --workers {W} --replicas {R} --top-k {K}` "
        "(one thread, medians of 5 rounds of 400 calls).", "",
        table(["tokens", "single holder (partition) µs", f"explicit, {R} replicas (place) µs"],
              rows)]), "placement")


if __name__ == "__main__":
    finish(main())
