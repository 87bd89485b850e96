"""The experts' gated activation, h = act(gate, up), for every family served.

    plain SwiGLU (Mixtral, Qwen-MoE, DeepSeek, GLM, MiniMax):  silu(gate) * up
    clamped SwiGLU (GPT-OSS):  g = min(gate, limit); u = clamp(up, -limit, limit);
                               g * sigmoid(alpha * g) * (u + up_offset), alpha 1.702, limit 7, offset 1

Expert biases (GPT-OSS: `gate_up_proj_bias`, `down_proj_bias`) are added before the activation and to the
down projection's output, before the routed weight (as transformers computes them).

Shapes: n rows, I expert width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GatedAct:
    alpha: float = 1.0              # sigmoid gain: gate * sigmoid(alpha * gate)
    limit: float | None = None      # clamp: gate above, up on both sides; None = no clamp
    up_offset: float = 0.0          # added to up after the clamp

    def __post_init__(self) -> None:
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ValueError(f"gated activation: alpha must be a positive number, got {self.alpha}")
        if self.limit is not None and (not math.isfinite(self.limit) or self.limit <= 0):
            raise ValueError(f"gated activation: limit must be a positive number or None, got {self.limit}")

    @property
    def plain(self) -> bool:
        return self.alpha == 1.0 and self.limit is None and self.up_offset == 0.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [n, I] -> h [n, I] in their dtype."""
        if self.plain:
            return torch.nn.functional.silu(gate) * up
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            up = up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + self.up_offset)


SILU = GatedAct()
