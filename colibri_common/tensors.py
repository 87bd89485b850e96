"""The tensor names and shapes each architecture needs: one table used by the router, the workers and
`colibri validate`."""

from __future__ import annotations

from colibri_common.config import ModelConfig

Spec = tuple[str, tuple[int, ...]]


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def attention_tensors(cfg: ModelConfig, layer: int) -> list[Spec]:
    p = layer_prefix(layer) + "self_attn."
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    out: list[Spec] = [(p + "q_proj.weight", (q, H)), (p + "k_proj.weight", (kv, H)),
                       (p + "v_proj.weight", (kv, H)), (p + "o_proj.weight", (H, q))]
    if cfg.qkv_bias:
        out += [(p + "q_proj.bias", (q,)), (p + "k_proj.bias", (kv,)), (p + "v_proj.bias", (kv,))]
    if cfg.o_bias:
        out.append((p + "o_proj.bias", (H,)))
    if cfg.arch.qk_norm == "head":
        out += [(p + "q_norm.weight", (D,)), (p + "k_norm.weight", (D,))]
    elif cfg.arch.qk_norm == "full":
        out += [(p + "q_norm.weight", (q,)), (p + "k_norm.weight", (kv,))]
    return out


def mlp_tensors(prefix: str, width: int, hidden: int, names: tuple[str, str, str]) -> list[Spec]:
    g, u, d = names
    return [(f"{prefix}{g}.weight", (width, hidden)), (f"{prefix}{u}.weight", (width, hidden)),
            (f"{prefix}{d}.weight", (hidden, width))]


def router_layer_tensors(cfg: ModelConfig, layer: int) -> list[Spec]:
    """Everything of one layer the router holds (all but the routed experts)."""
    p = layer_prefix(layer)
    H = cfg.hidden_size
    out = [(p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,))]
    out += attention_tensors(cfg, layer)
    if cfg.is_moe_layer(layer):
        moe = p + cfg.arch.moe_prefix + "."
        out.append((moe + cfg.arch.gate_name + ".weight", (cfg.num_experts, H)))
        if cfg.shared_expert_intermediate_size:
            out += mlp_tensors(moe + "shared_expert.", cfg.shared_expert_intermediate_size, H,
                               ("gate_proj", "up_proj", "down_proj"))
            out.append((moe + "shared_expert_gate.weight", (1, H)))
    else:
        out += mlp_tensors(p + "mlp.", cfg.dense_intermediate_size, H, ("gate_proj", "up_proj", "down_proj"))
    return out


def router_tensors(cfg: ModelConfig) -> list[Spec]:
    out: list[Spec] = [("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)),
                       ("model.norm.weight", (cfg.hidden_size,))]
    if not cfg.tie_word_embeddings:
        out.append(("lm_head.weight", (cfg.vocab_size, cfg.hidden_size)))
    for layer in range(cfg.num_layers):
        out += router_layer_tensors(cfg, layer)
    return out


def expert_tensors(cfg: ModelConfig, layer: int, expert: int) -> list[Spec]:
    """(gate, up, down) of one routed expert, in the per-expert layout checkpoints are published in."""
    prefix = f"{layer_prefix(layer)}{cfg.arch.moe_prefix}.experts.{expert}."
    return mlp_tensors(prefix, cfg.moe_intermediate_size, cfg.hidden_size, cfg.arch.expert_names)


def fused_expert_tensors(cfg: ModelConfig, layer: int) -> list[Spec]:
    """The fused layout some checkpoints use instead: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    prefix = f"{layer_prefix(layer)}{cfg.arch.moe_prefix}.experts."
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return [(prefix + "gate_up_proj", (E, 2 * I, H)), (prefix + "down_proj", (E, H, I))]
