"""The router's dense weights (everything but the routed experts), loaded from the mapped checkpoint."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.tensors import attention_tensors, layer_prefix


@dataclass
class LayerWeights:
    ln1: torch.Tensor                     # [H]
    ln2: torch.Tensor                     # [H]
    qkv: torch.Tensor                     # [(Hq + 2 Hkv) D, H] q, k, v rows stacked
    qkv_bias: torch.Tensor | None         # [(Hq + 2 Hkv) D]
    o: torch.Tensor                       # [H, Hq D]
    o_bias: torch.Tensor | None           # [H]
    q_norm: torch.Tensor | None           # [D] per head, or [Hq D] full width
    k_norm: torch.Tensor | None
    gate: torch.Tensor | None = None      # [E, H] router of a MoE layer
    mlp_gate_up: torch.Tensor | None = None  # [2I, H] dense MLP, or the shared expert of a MoE layer
    mlp_down: torch.Tensor | None = None     # [H, I]
    shared_gate: torch.Tensor | None = None  # [1, H] sigmoid gate of the shared expert


@dataclass
class RouterWeights:
    embed: torch.Tensor                   # [V, H]
    norm: torch.Tensor                    # [H]
    lm_head: torch.Tensor                 # [V, H]
    layers: list[LayerWeights]

    @staticmethod
    def load(ckpt: Checkpoint, cfg: ModelConfig, dtype: torch.dtype, progress: bool = False) -> RouterWeights:
        def get(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            return ckpt.load(name, shape, dtype)

        H = cfg.hidden_size
        embed = get("model.embed_tokens.weight", (cfg.vocab_size, H))
        lm_head = embed if cfg.tie_word_embeddings else get("lm_head.weight", (cfg.vocab_size, H))
        layers = []
        for i in tqdm(range(cfg.num_layers), desc="router weights", unit="layer", disable=not progress):
            p = layer_prefix(i)
            att = {name.rsplit("self_attn.", 1)[1]: get(name, shape) for name, shape in attention_tensors(cfg, i)}
            lw = LayerWeights(
                ln1=get(p + "input_layernorm.weight", (H,)),
                ln2=get(p + "post_attention_layernorm.weight", (H,)),
                qkv=torch.cat([att["q_proj.weight"], att["k_proj.weight"], att["v_proj.weight"]]),
                qkv_bias=(torch.cat([att["q_proj.bias"], att["k_proj.bias"], att["v_proj.bias"]])
                          if cfg.qkv_bias else None),
                o=att["o_proj.weight"], o_bias=att.get("o_proj.bias"),
                q_norm=att.get("q_norm.weight"), k_norm=att.get("k_norm.weight"),
            )
            if cfg.is_moe_layer(i):
                moe = p + cfg.arch.moe_prefix + "."
                lw.gate = get(moe + cfg.arch.gate_name + ".weight", (cfg.num_experts, H))
                if cfg.shared_expert_intermediate_size:
                    lw.mlp_gate_up, lw.mlp_down = _mlp(get, moe + "shared_expert.",
                                                       cfg.shared_expert_intermediate_size, H)
                    lw.shared_gate = get(moe + "shared_expert_gate.weight", (1, H))
            else:
                lw.mlp_gate_up, lw.mlp_down = _mlp(get, p + "mlp.", cfg.dense_intermediate_size, H)
            layers.append(lw)
        return RouterWeights(embed=embed, norm=get("model.norm.weight", (H,)), lm_head=lm_head, layers=layers)


def _mlp(get, prefix: str, width: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    gate_up = torch.cat([get(prefix + "gate_proj.weight", (width, hidden)),
                         get(prefix + "up_proj.weight", (width, hidden))])   # [2I, H]
    return gate_up, get(prefix + "down_proj.weight", (hidden, width))         # [H, I]
