"""A placement plan as the dispatch reads it: for each layer, which worker (by index) holds each expert.

The router indexes workers in the order it first met them; a removed worker keeps its index and holds nothing,
so tensors and metrics indexed by worker never shift under a step in flight.

Shapes: L layers of the model (only MoE ones hold experts), E experts per layer, W workers ever known.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from colibri_common.placement import held_digest
from router_service.moe.partition import holding_of
from router_service.moe.plan import Plan


@dataclass(frozen=True)
class Table:
    plan: Plan
    holders: torch.Tensor              # [L, E, W] bool: expert e of layer l is on worker w
    owner: torch.Tensor                # [L, E] one holder of each expert (-1: none), for the single-holder path
    explicit: bool                     # send each worker its pairs (-1 for others'): replicas, or a router's plan
                                       # (a worker may hold more than the plan while a switch is under way)
    holding: tuple[list[tuple[int, ...]], ...]   # [L][E] each expert's workers, ascending (`holding_of(holders)`)
    digests: tuple[int, ...] = ()      # [W] held_digest of each worker's experts in the plan (0: none), sent with the
                                       # whole top-k so a worker holding another set refuses it
    # [L][E] `owner` as lists, so that a few rows' partition reads no tensor: derived, never given
    owner_lists: tuple[list[int], ...] = field(init=False, repr=False, compare=False)
    # [L] each layer's [E, W] of `holders`, cut once: a layer's dispatch takes its own without an indexing op
    layer_holders: tuple[torch.Tensor, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "owner_lists", tuple(self.owner.tolist()))
        object.__setattr__(self, "layer_holders", tuple(self.holders.unbind(0)))

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    @staticmethod
    def of(plan: Plan, index: dict[str, int], num_layers: int, num_experts: int) -> Table:
        """The table of `plan` for workers numbered by `index` (address -> worker index)."""
        W = max(index.values(), default=-1) + 1
        holders = torch.zeros(num_layers, num_experts, W, dtype=torch.bool)      # [L, E, W]
        for layer, per in plan.held.items():
            for address, experts in per.items():
                if experts:
                    holders[layer, experts, index[address]] = True
        counts = holders.sum(dim=2)                                               # [L, E]
        first = holders.to(torch.int8).argmax(dim=2) if W else torch.zeros_like(counts)
        owner = torch.where(counts > 0, first, -1)                                # [L, E]
        replicated = bool((counts > 1).any())
        digests = [0] * W
        for address in plan.workers:
            digests[index[address]] = held_digest(plan.of(address))
        return Table(plan, holders, owner, explicit=replicated or plan.epoch > 0,
                     holding=tuple(holding_of(h) for h in holders), digests=tuple(digests))

    def held_elsewhere(self, w: int, live: list[bool]) -> bool:
        """Whether every expert worker w holds has another live holder (live [W']: liveness by worker index), so
        its pairs can go elsewhere at once."""
        W = self.holders.shape[2]
        others = [i for i in range(min(W, len(live))) if i != w and live[i]]
        if w >= W or not others:
            return False
        mine = self.holders[:, :, w]                                              # [L, E]
        return not bool((mine & ~self.holders[:, :, others].any(dim=2)).any())

    def holders_of_lost(self, layer: int, ids: torch.Tensor, live: list[bool]) -> torch.Tensor:
        """[W] bool: the workers that hold an expert among `ids` (any shape, -1 = none) that no live worker holds."""
        ids = ids.flatten().long()
        holders = self.holders[layer][ids[ids >= 0]]                                            # [n, W]
        return holders[~(holders & torch.tensor(live, dtype=torch.bool)).any(dim=1)].any(dim=0)  # [W]

    def in_plan(self, w: int) -> bool:
        """Whether worker w holds anything in this plan."""
        return w < self.holders.shape[2] and bool(self.holders[:, :, w].any())
