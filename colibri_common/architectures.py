"""The per-architecture data: how each supported architecture differs from the one shared decoder layer
(`ArchSpec`: tensor names, qk-norm kind, attention bias, shared experts, dense-layer rules, routing, and the
defaults its transformers config class gives keys a config.json leaves out), keyed by config.json's
`architectures` name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    """How one architecture differs from the shared decoder layer."""

    moe_prefix: str                # module path of the MoE block inside a layer
    gate_name: str                 # router linear inside the MoE block
    expert_names: tuple[str, str, str]  # per-expert (gate, up, down) linear names
    qk_norm: str = "none"          # "none" | "head" (per head, Qwen3) | "full" (full width, OLMoE)
    qk_norm_key: str | None = None  # config key that turns qk_norm on (GLM-4.5: use_qk_norm); None = always
    bias_key: str = "attention_bias"  # config key that turns on q/k/v (and maybe o) biases
    bias_default: bool = False
    o_proj_bias: bool = True       # o_proj carries a bias whenever the q/k/v projections do
    shared_expert: bool = False    # a dense shared expert with a sigmoid gate (Qwen2-MoE)
    shared_experts_key: str | None = None  # ungated shared experts of this count x the expert width (GLM-4.5)
    shared_prefix: str = "shared_expert"   # the shared expert's module inside the MoE block
    dense_first_key: str | None = None     # config key: the first N layers are dense MLPs (GLM-4.5, DeepSeek)
    scoring: str = "softmax"       # router scores: "softmax" | "sigmoid" (kernels/routing.py)
    routing_bias: str | None = None  # the choice-only correction bias inside the MoE block, if the model has one
    group_score: str = "max"       # group-limited routing: a group's score ("max" | "top2")
    gate_fp32: bool = False      # the gate computes in float32 whatever the compute dtype (as transformers)
    attention: str = "mha"         # "mha" (grouped-query) | "mla" (DeepSeek's latent attention, a latent KV cache)
    renormalize: bool | None = None  # fixed by the architecture (Mixtral's and MiniMax-M2's routers always
                                     # renormalise, DeepSeek-V2's never); None: config.json's norm_topk_prob
    groups_when: tuple[str, str] | None = None      # (key, value): group-limited routing only when key == value
    allowed: tuple[tuple[str, tuple[object, ...]], ...] = ()   # config values the architecture can serve
    defaults: tuple[tuple[str, object], ...] = ()   # the transformers config class's defaults for keys a config.json
                                                    # may omit, where they are not the generic ones below
                                                    # (tests/test_config_defaults.py holds them to transformers)
    norm_topk_default: bool = False
    experts_key: tuple[str, ...] = ("num_experts", "num_local_experts")
    topk_key: str = "num_experts_per_tok"
    expert_width_key: str = "moe_intermediate_size"
    gate_bias: bool = False        # the router's linear has a bias, added to the logits (GPT-OSS)
    fused_experts: str = "stacked"  # fused layout on disk: "stacked" gate_up [E, 2I, H] (gate rows, up rows) |
                                   # "interleaved_t" GPT-OSS's gate_up [E, H, 2I] (gate, up columns alternate)
    expert_bias: bool = False      # the experts' gate_up and down carry biases (GPT-OSS)
    clamped_swiglu: bool = False   # experts: clamped SwiGLU with swiglu_alpha / swiglu_limit, up + 1 (GPT-OSS)
    attention_sinks: bool = False  # a learned per-head logit in every softmax's denominator (GPT-OSS)
    sliding: str = "none"          # sliding-window layers: "none" | "all" (when sliding_window is set, Mixtral) |
                                   # "layer_types" (config.layer_types names each layer's kind, GPT-OSS)
    norm_scale_fp32: bool = False  # RMSNorm multiplies its weight in float32, then casts (GPT-OSS)


# DeepSeek-V2/V3's latent attention sizes where a config.json leaves them out, as their transformers classes
MLA_DEFAULTS = (("kv_lora_rank", 512), ("qk_nope_head_dim", 128), ("qk_rope_head_dim", 64), ("v_head_dim", 128))

ARCHITECTURES: dict[str, ArchSpec] = {
    "MixtralForCausalLM": ArchSpec(
        moe_prefix="block_sparse_moe", gate_name="gate", expert_names=("w1", "w3", "w2"),
        renormalize=True, experts_key=("num_local_experts",), expert_width_key="intermediate_size",
        sliding="all",
        defaults=(("rms_norm_eps", 1e-5), ("rope_theta", 1e6), ("max_position_embeddings", 131072),
                  ("num_key_value_heads", 8)),
    ),
    "Qwen2MoeForCausalLM": ArchSpec(
        moe_prefix="mlp", gate_name="gate", expert_names=("gate_proj", "up_proj", "down_proj"),
        bias_key="qkv_bias", bias_default=True, o_proj_bias=False, shared_expert=True,
        defaults=(("max_position_embeddings", 32768), ("num_key_value_heads", 16),
                  ("shared_expert_intermediate_size", 5632)),       # transformers' default
    ),
    "Qwen3MoeForCausalLM": ArchSpec(
        moe_prefix="mlp", gate_name="gate", expert_names=("gate_proj", "up_proj", "down_proj"),
        qk_norm="head",
        defaults=(("max_position_embeddings", 32768), ("num_key_value_heads", 4)),
    ),
    "OlmoeForCausalLM": ArchSpec(
        moe_prefix="mlp", gate_name="gate", expert_names=("gate_proj", "up_proj", "down_proj"),
        qk_norm="full", expert_width_key="intermediate_size",
        defaults=(("rms_norm_eps", 1e-5), ("max_position_embeddings", 4096)),   # left-out kv heads: all heads
    ),
    "Glm4MoeForCausalLM": ArchSpec(
        moe_prefix="mlp", gate_name="gate", expert_names=("gate_proj", "up_proj", "down_proj"),
        qk_norm="head", qk_norm_key="use_qk_norm", o_proj_bias=False, experts_key=("n_routed_experts",),
        shared_experts_key="n_shared_experts", shared_prefix="shared_experts", dense_first_key="first_k_dense_replace",
        scoring="sigmoid", routing_bias="gate.e_score_correction_bias", group_score="top2", gate_fp32=True,
        norm_topk_default=True,
        defaults=(("partial_rotary_factor", 0.5), ("n_shared_experts", 1), ("first_k_dense_replace", 1),
                  ("rms_norm_eps", 1e-5), ("max_position_embeddings", 131072), ("num_key_value_heads", 8),
                  ("num_nextn_predict_layers", 1)),
    ),
    "DeepseekV2ForCausalLM": ArchSpec(
        moe_prefix="mlp", gate_name="gate", expert_names=("gate_proj", "up_proj", "down_proj"), o_proj_bias=False,
        experts_key=("n_routed_experts",), shared_experts_key="n_shared_experts", shared_prefix="shared_experts",
        dense_first_key="first_k_dense_replace", gate_fp32=True, attention="mla", renormalize=False,
        groups_when=("topk_method", "group_limited_greedy"),
        allowed=(("topk_method", ("greedy", "group_limited_greedy")), ("scoring_func", (None, "softmax")),
                 ("moe_layer_freq", (None, 1)), ("mlp_bias", (None, False))),
        defaults=(("topk_method", "greedy"), ("n_shared_experts", 2), ("max_position_embeddings", 2048),
                  *MLA_DEFAULTS),
    ),
    "DeepseekV3ForCausalLM": ArchSpec(
        moe_prefix="mlp", gate_name="gate", expert_names=("gate_proj", "up_proj", "down_proj"), o_proj_bias=False,
        experts_key=("n_routed_experts",), shared_experts_key="n_shared_experts", shared_prefix="shared_experts",
        dense_first_key="first_k_dense_replace", scoring="sigmoid", routing_bias="gate.e_score_correction_bias",
        group_score="top2", gate_fp32=True, attention="mla", norm_topk_default=True,
        allowed=(("topk_method", (None, "noaux_tc")), ("scoring_func", (None, "sigmoid")),
                 ("moe_layer_freq", (None, 1))),
        defaults=(("n_shared_experts", 1), ("routed_scaling_factor", 2.5), ("n_group", 8), ("topk_group", 4),
                  ("first_k_dense_replace", 3), ("max_position_embeddings", 4096), ("num_nextn_predict_layers", 1),
                  *MLA_DEFAULTS),
    ),
    "MiniMaxM2ForCausalLM": ArchSpec(
        moe_prefix="block_sparse_moe", gate_name="gate", expert_names=("w1", "w3", "w2"), qk_norm="full",
        renormalize=True, experts_key=("num_local_experts",), expert_width_key="intermediate_size",
        scoring="sigmoid", routing_bias="e_score_correction_bias",
        defaults=(("rope_theta", 5e6), ("max_position_embeddings", 196608), ("num_key_value_heads", 8),
                  ("head_dim", 128)),
    ),
    "GptOssForCausalLM": ArchSpec(
        moe_prefix="mlp", gate_name="router", expert_names=("gate_proj", "up_proj", "down_proj"),
        bias_default=True, experts_key=("num_local_experts",), expert_width_key="intermediate_size",
        scoring="topk_softmax", gate_bias=True, fused_experts="interleaved_t", expert_bias=True,
        clamped_swiglu=True, attention_sinks=True, sliding="layer_types", norm_scale_fp32=True,
        defaults=(("rope_theta", 150000.0), ("sliding_window", 128), ("swiglu_alpha", 1.702), ("swiglu_limit", 7.0),
                  ("rms_norm_eps", 1e-5), ("head_dim", 64), ("max_position_embeddings", 131072),
                  ("num_key_value_heads", 8),
                  ("rope_parameters", {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 4096})),
    ),
}
SLIDING_KINDS = ("sliding_attention", "full_attention")
