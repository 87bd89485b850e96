"""The small numeric building blocks of the decoder, written to match transformers' maths exactly.

Shapes: T tokens, H hidden size, D head dim, I an MLP's width.
"""

from __future__ import annotations

import torch

from kernels.cpu_linear import linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, scale in the input dtype (as transformers' RMSNorm does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Rope:
    """Default rotary embedding: inverse frequencies in float32, cos/sin cast to the activation dtype."""

    def __init__(self, head_dim: int, theta: float, device: torch.device | str = "cpu") -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))  # [D/2]
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]   # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)                         # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, R]: the first R <= D dims of each head rotate, the rest pass (partial
    rotary, as transformers' apply_rotary_pos_emb)."""
    R = cos.shape[-1]
    rot = x if R == x.shape[-1] else x[..., :R]                       # [T, heads, R]
    half = R // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)  # [T, heads, R]
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return out if R == x.shape[-1] else torch.cat((out, x[..., R:]), dim=-1)


def silu_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A dense SwiGLU MLP with fused gate/up rows: gate_up [2I, H], down [H, I]."""
    gu = linear(x, gate_up)                                            # [T, 2I]
    i = down.shape[1]
    return linear(torch.nn.functional.silu(gu[:, :i]) * gu[:, i:], down)  # [T, H]
