"""The checkpoint's tensor names and shapes, per role: the one table the router's weights, the workers and
`colibri validate` all read. Names follow the Hugging Face checkpoints as published.

Shapes: V vocabulary, H hidden size, D head dim, Hq / Hkv query / key-value heads, E experts per layer,
I an expert's (or a dense MLP's) width.
"""

from __future__ import annotations

from collections.abc import Collection, Container

from colibri_common.config import ModelConfig
from colibri_common.errors import CheckpointError
from kernels import fp8, mxfp4

Spec = tuple[str, tuple[int, ...]]
MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def model_tensors(cfg: ModelConfig) -> dict[str, Spec]:
    """The tensors outside the layers: embed [V, H], final norm [H], lm_head [V, H] (unless tied)."""
    V, H = cfg.vocab_size, cfg.hidden_size
    out = {"embed": ("model.embed_tokens.weight", (V, H)), "norm": ("model.norm.weight", (H,))}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = ("lm_head.weight", (V, H))
    return out


def mla_tensors(cfg: ModelConfig, layer: int) -> dict[str, Spec]:
    """Latent attention's roles: q (or q_a, q_a_norm, q_b), kv_a [Lkv + Dr, H], kv_a_norm [Lkv],
    kv_b [Hq (Dn + Dv), Lkv], o [H, Hq Dv]."""
    m = cfg.mla
    assert m is not None
    p = layer_prefix(layer) + "self_attn."
    H, heads = cfg.hidden_size, cfg.num_heads
    q_out = heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
    out: dict[str, Spec] = {}
    if m.q_lora_rank:
        out |= {"q_a": (p + "q_a_proj.weight", (m.q_lora_rank, H)),
                "q_a_norm": (p + "q_a_layernorm.weight", (m.q_lora_rank,)),
                "q_b": (p + "q_b_proj.weight", (q_out, m.q_lora_rank))}
    else:
        out["q"] = (p + "q_proj.weight", (q_out, H))
    out |= {"kv_a": (p + "kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, H)),
            "kv_a_norm": (p + "kv_a_layernorm.weight", (m.kv_lora_rank,)),
            "kv_b": (p + "kv_b_proj.weight", (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)),
            "o": (p + "o_proj.weight", (H, heads * m.v_head_dim))}
    return out


def attention_tensors(cfg: ModelConfig, layer: int) -> dict[str, Spec]:
    """Roles q, k, v, o (+ q_bias, k_bias, v_bias, o_bias, q_norm, k_norm when the architecture has them)."""
    if cfg.mla is not None:
        return mla_tensors(cfg, layer)
    p = layer_prefix(layer) + "self_attn."
    H, D = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    out: dict[str, Spec] = {"q": (p + "q_proj.weight", (q, H)), "k": (p + "k_proj.weight", (kv, H)),
                            "v": (p + "v_proj.weight", (kv, H)), "o": (p + "o_proj.weight", (H, q))}
    if cfg.qkv_bias:
        out |= {"q_bias": (p + "q_proj.bias", (q,)), "k_bias": (p + "k_proj.bias", (kv,)),
                "v_bias": (p + "v_proj.bias", (kv,))}
    if cfg.o_bias:
        out["o_bias"] = (p + "o_proj.bias", (H,))
    if cfg.arch.attention_sinks:
        out["sinks"] = (p + "sinks", (cfg.num_heads,))
    if cfg.qk_norm == "head":
        out |= {"q_norm": (p + "q_norm.weight", (D,)), "k_norm": (p + "k_norm.weight", (D,))}
    elif cfg.qk_norm == "full":
        out |= {"q_norm": (p + "q_norm.weight", (q,)), "k_norm": (p + "k_norm.weight", (kv,))}
    return out


def mlp_tensors(prefix: str, width: int, hidden: int, names: tuple[str, str, str] = MLP_NAMES
                ) -> dict[str, Spec]:
    """Roles gate [I, H], up [I, H], down [H, I] of one SwiGLU MLP."""
    g, u, d = names
    return {"gate": (f"{prefix}{g}.weight", (width, hidden)), "up": (f"{prefix}{u}.weight", (width, hidden)),
            "down": (f"{prefix}{d}.weight", (hidden, width))}


def router_layer_tensors(cfg: ModelConfig, layer: int) -> dict[str, Spec]:
    """Everything of one layer the router holds (all but the routed experts), by role: ln1, ln2, attention
    roles; then `gate` [E, H] (+ its logits' `gate_bias` [E], its choice-only `gate_correction` [E], shared
    experts `shared.gate|up|down` and a shared expert's sigmoid gate `shared_gate` [1, H] where the
    architecture has them) in a MoE layer, or a dense MLP `mlp.gate|up|down`."""
    p = layer_prefix(layer)
    H = cfg.hidden_size
    out: dict[str, Spec] = {"ln1": (p + "input_layernorm.weight", (H,)),
                            "ln2": (p + "post_attention_layernorm.weight", (H,))}
    out |= attention_tensors(cfg, layer)
    if cfg.is_moe_layer(layer):
        moe = p + cfg.arch.moe_prefix + "."
        out["gate"] = (moe + cfg.arch.gate_name + ".weight", (cfg.num_experts, H))
        if cfg.arch.gate_bias:
            out["gate_bias"] = (moe + cfg.arch.gate_name + ".bias", (cfg.num_experts,))
        if cfg.arch.routing_bias:
            out["gate_correction"] = (moe + cfg.arch.routing_bias, (cfg.num_experts,))
        if cfg.shared_expert_intermediate_size:
            shared = mlp_tensors(moe + cfg.arch.shared_prefix + ".", cfg.shared_expert_intermediate_size, H)
            out |= {f"shared.{role}": spec for role, spec in shared.items()}
            if cfg.arch.shared_expert:                                   # Qwen2-MoE's is gated
                out["shared_gate"] = (moe + "shared_expert_gate.weight", (1, H))
    else:
        dense = mlp_tensors(p + "mlp.", cfg.dense_intermediate_size, H)
        out |= {f"mlp.{role}": spec for role, spec in dense.items()}
    return out


def router_tensors(cfg: ModelConfig) -> list[Spec]:
    out = list(model_tensors(cfg).values())
    for layer in range(cfg.num_layers):
        out += router_layer_tensors(cfg, layer).values()
    return out


def expert_tensors(cfg: ModelConfig, layer: int, expert: int) -> dict[str, Spec]:
    """Roles gate, up, down of one routed expert, in the per-expert layout checkpoints are published in."""
    prefix = f"{layer_prefix(layer)}{cfg.arch.moe_prefix}.experts.{expert}."
    return mlp_tensors(prefix, cfg.moe_intermediate_size, cfg.hidden_size, cfg.arch.expert_names)


def stored_expert_tensors(cfg: ModelConfig, layer: int, expert: int, names: Container[str]
                          ) -> tuple[str, dict[str, Spec]]:
    """The tensors that hold `expert` in a checkpoint whose tensor names are `names`: (layout, specs).
    Layouts: "per_expert" (one tensor per expert and projection), or layer-wide tensors indexed by expert:
    "stacked", "interleaved_t" (GPT-OSS) and "mxfp4" (GPT-OSS's published, quantised experts)."""
    fused = fused_expert_tensors(cfg, layer)
    if fused["gate_up"][0] in names:
        per_expert = expert_tensors(cfg, layer, expert)["down"][0]
        if fused["down"][0] not in names and per_expert in names:
            raise CheckpointError(f"layer {layer} stores its experts' gate and up fused ('{fused['gate_up'][0]}') "
                                  f"but their down projections one per expert ('{per_expert}'): a layer's "
                                  f"experts are read in one layout; convert the checkpoint whole")
        return cfg.arch.fused_experts, fused
    mx = mxfp4_expert_tensors(cfg, layer)
    if mx["gate_up_blocks"][0] in names:
        return "mxfp4", mx
    return "per_expert", expert_tensors(cfg, layer, expert)


def fused_expert_tensors(cfg: ModelConfig, layer: int) -> dict[str, Spec]:
    """The layer-wide layouts: "stacked" gate_up [E, 2I, H] (gate rows, then up rows), down [E, H, I]; GPT-OSS's
    "interleaved_t" gate_up [E, H, 2I] (gate and up columns alternate), down [E, I, H]."""
    prefix = f"{layer_prefix(layer)}{cfg.arch.moe_prefix}.experts."
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    if cfg.arch.fused_experts == "interleaved_t":
        return {"gate_up": (prefix + "gate_up_proj", (E, H, 2 * I)), "down": (prefix + "down_proj", (E, I, H))}
    return {"gate_up": (prefix + "gate_up_proj", (E, 2 * I, H)), "down": (prefix + "down_proj", (E, H, I))}


def mxfp4_expert_tensors(cfg: ModelConfig, layer: int) -> dict[str, Spec]:
    """GPT-OSS's MXFP4 experts: per output row, blocks [.., Din / 32, 16] uint8 (two e2m1 values a byte, low nibble
    first) and scales [.., Din / 32] uint8 (e8m0, 2^(s - 127)); gate_up rows alternate gate and up."""
    prefix = f"{layer_prefix(layer)}{cfg.arch.moe_prefix}.experts."
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gh, gi = -(-H // mxfp4.BLOCK), -(-I // mxfp4.BLOCK)
    return {"gate_up_blocks": (prefix + "gate_up_proj_blocks", (E, 2 * I, gh, mxfp4.BLOCK // 2)),
            "gate_up_scales": (prefix + "gate_up_proj_scales", (E, 2 * I, gh)),
            "down_blocks": (prefix + "down_proj_blocks", (E, H, gi, mxfp4.BLOCK // 2)),
            "down_scales": (prefix + "down_proj_scales", (E, H, gi))}


def expert_bias_tensors(cfg: ModelConfig, layer: int) -> dict[str, Spec]:
    """The experts' biases of a layer (GPT-OSS): gate_up [E, 2I] (gate and up alternate), down [E, H]; none for
    architectures without them."""
    if not cfg.arch.expert_bias:
        return {}
    prefix = f"{layer_prefix(layer)}{cfg.arch.moe_prefix}.experts."
    E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    return {"gate_up": (prefix + "gate_up_proj_bias", (E, 2 * I)), "down": (prefix + "down_proj_bias", (E, H))}


def unused_tensors(cfg: ModelConfig, names: Collection[str]) -> tuple[list[str], list[str]]:
    """The stored tensors the model never reads, as (unused, next-token layers): the second are the layers past
    num_hidden_layers that `num_nextn_predict_layers` declares (DeepSeek-V3's and GLM-4.5's multi-token
    prediction, which transformers leaves out too); the first is everything else nothing reads (a config that
    turns off what the checkpoint has: biases, qk-norm, layers past num_hidden_layers)."""
    used = {name for name, _ in router_tensors(cfg)}
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            used |= {name for name, _ in stored_expert_tensors(cfg, layer, e, names)[1].values()}
        used |= {name for name, _ in expert_bias_tensors(cfg, layer).values()}
    used |= {name + fp8.SCALE_SUFFIX for name in used}       # an FP8 weight's block scales
    nextn = tuple(layer_prefix(i) for i in range(cfg.num_layers, cfg.num_layers + cfg.nextn_layers))
    unused, predict = [], []
    for name in sorted(names):
        if name not in used:
            (predict if name.startswith(nextn) else unused).append(name)
    return unused, predict


def summarise(names: list[str], limit: int = 3) -> str:
    """The first few of `names`, and how many more."""
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
