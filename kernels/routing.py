"""Gate logits -> each token's top-k experts and their weights, for every routing the supported families use.

    softmax   (Mixtral, Qwen-MoE, OLMoE, DeepSeek-V2): softmax over all experts, then the top k
    sigmoid   (DeepSeek-V3, Kimi K2, GLM-4.5, MiniMax-M2): sigmoid per expert, then the top k
    topk_softmax (GPT-OSS): the top k logits, then a softmax over those k

Options (`Routing`): a score-correction `bias` added for choosing only (the weights are the unbiased
scores); group-limited choice (`num_groups` groups of E / num_groups experts, only the best `topk_groups`
groups' experts may be chosen; a group's score is its best expert's ("max", DeepSeek-V2) or its two best
experts' sum ("top2", DeepSeek-V3)); renormalising the k weights to sum to 1; a final `scaling` factor.

Shapes: T tokens, E experts, G groups, k experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORINGS = ("softmax", "sigmoid", "topk_softmax")
GROUP_SCORES = ("max", "top2")


@dataclass(frozen=True)
class Routing:
    """How one model routes; validated at construction (a config that cannot work fails here, named)."""

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"
    scaling: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"routing scoring '{self.scoring}' is not one of {', '.join(SCORINGS)}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"routing group score '{self.group_score}' is not one of {', '.join(GROUP_SCORES)}")
        if self.top_k <= 0:
            raise ValueError(f"routing top_k must be positive, got {self.top_k}")
        if self.num_groups < 1 or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"routing groups: need 1 <= topk_groups ({self.topk_groups}) <= num_groups "
                             f"({self.num_groups})")
        if self.num_groups > 1 and self.scoring == "topk_softmax":
            raise ValueError("routing: group-limited choice needs softmax or sigmoid scores")

    @property
    def grouped(self) -> bool:
        return self.num_groups > 1

    def check(self, num_experts: int) -> None:
        if not 0 < self.top_k <= num_experts:
            raise ValueError(f"routing top_k={self.top_k} must be in 1..{num_experts}")
        if num_experts % self.num_groups:
            raise ValueError(f"routing: {num_experts} experts do not split into {self.num_groups} groups")
        if self.grouped and self.group_score == "top2" and num_experts // self.num_groups < 2:
            raise ValueError(f"routing: a group's top-2 score needs groups of 2 or more experts; {num_experts} "
                             f"experts in {self.num_groups} groups (n_group) have {num_experts // self.num_groups}")
        if self.grouped and self.top_k > self.topk_groups * (num_experts // self.num_groups):
            raise ValueError(f"routing: top_k={self.top_k} exceeds the {self.topk_groups} chosen groups' "
                             f"{self.topk_groups * (num_experts // self.num_groups)} experts")


def topk_route_torch(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights float32 [T, k], ids int64 [T, k]), the chosen experts best first."""
    T, E = logits.shape
    k = routing.top_k
    x = logits.float()                                                        # [T, E]
    if routing.scoring == "topk_softmax":
        top, ids = torch.topk(x, k, dim=-1)                                   # [T, k]
        return torch.softmax(top, dim=-1) * routing.scaling, ids
    scores = torch.softmax(x, dim=-1) if routing.scoring == "softmax" else torch.sigmoid(x)     # [T, E]
    choice = scores if bias is None else scores + bias.float()                # [T, E] for choosing only
    if routing.grouped:
        G = routing.num_groups
        per_group = choice.view(T, G, E // G)                                 # [T, G, E/G]
        if routing.group_score == "max":
            group = per_group.max(dim=-1).values                              # [T, G]
        else:
            group = per_group.topk(2, dim=-1).values.sum(dim=-1)              # [T, G]
        kept = torch.zeros(T, G, dtype=torch.bool, device=x.device)
        kept.scatter_(1, torch.topk(group, routing.topk_groups, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(E // G, dim=1), float("-inf"))
    ids = torch.topk(choice, k, dim=-1).indices                               # [T, k]
    weights = scores.gather(1, ids)                                           # [T, k] unbiased
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, ids
