"""config.json as transformers reads it: a key a checkpoint's config leaves out takes the default of that
architecture's transformers config class (not a generic one), the routers renormalise where transformers' do,
and an activation the experts do not compute is refused. transformers' own config classes are the oracle."""

from __future__ import annotations

import pytest
import transformers

from colibri_common.architectures import ARCHITECTURES
from colibri_common.config import ConfigError, ModelConfig

CLASSES = {
    "MixtralForCausalLM": "MixtralConfig", "Qwen2MoeForCausalLM": "Qwen2MoeConfig",
    "Qwen3MoeForCausalLM": "Qwen3MoeConfig", "OlmoeForCausalLM": "OlmoeConfig", "Glm4MoeForCausalLM": "Glm4MoeConfig",
    "DeepseekV2ForCausalLM": "DeepseekV2Config", "DeepseekV3ForCausalLM": "DeepseekV3Config",
    "MiniMaxM2ForCausalLM": "MiniMaxM2Config", "GptOssForCausalLM": "GptOssConfig",
}
# the routers that read norm_topk_prob; Mixtral's and MiniMax-M2's always renormalise, DeepSeek-V2's never,
# GPT-OSS takes a softmax over the top-k logits (already a distribution)
READS_NORM_TOPK = {"Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "Glm4MoeForCausalLM",
                   "DeepseekV3ForCausalLM"}
ALWAYS_RENORMALISES = {"MixtralForCausalLM", "MiniMaxM2ForCausalLM"}


def minimal(arch: str) -> dict:
    """Only the sizes every architecture needs given; everything else left to the defaults."""
    spec = ARCHITECTURES[arch]
    raw = {"architectures": [arch], "hidden_size": 128, "num_attention_heads": 32, "num_hidden_layers": 4,
           "vocab_size": 128, spec.experts_key[0]: 64, spec.topk_key: 2, spec.expert_width_key: 32}
    raw.setdefault("intermediate_size", 48)
    if spec.attention == "mla":
        raw["q_lora_rank"] = None             # an explicit null is a plain q_proj in both (not the 1536 default)
    return raw


def theirs(arch: str, raw: dict):
    return getattr(transformers, CLASSES[arch])(**{k: v for k, v in raw.items() if k != "architectures"})


def test_every_architecture_is_checked():
    assert set(CLASSES) == set(ARCHITECTURES)


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_left_out_keys_take_the_architectures_transformers_defaults(arch):
    raw = minimal(arch)
    ours, ref = ModelConfig.from_dict(raw), theirs(arch, raw)
    rope = dict(ref.rope_parameters or {})
    assert ours.rms_norm_eps == ref.rms_norm_eps
    assert ours.rope_theta == rope["rope_theta"]
    assert ours.max_position_embeddings == ref.max_position_embeddings
    assert ours.tie_word_embeddings == ref.tie_word_embeddings
    if ours.mla is None:
        assert ours.num_kv_heads == ref.num_key_value_heads
        head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
        assert ours.head_dim == head_dim
        partial = rope.get("partial_rotary_factor", getattr(ref, "partial_rotary_factor", None)) or 1.0
        assert ours.rotary_dim == int(head_dim * partial)
    else:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            assert getattr(ours.mla, name) == getattr(ref, name), name
        assert ours.mla.rope_interleave == getattr(ref, "rope_interleave", True)
    if arch in READS_NORM_TOPK:
        assert ours.norm_topk_prob == ref.norm_topk_prob
    if hasattr(ref, "routed_scaling_factor"):
        assert ours.routed_scaling == ref.routed_scaling_factor
    if hasattr(ref, "first_k_dense_replace"):
        assert ours.moe_layers == tuple(range(ref.first_k_dense_replace, ref.num_hidden_layers))
    if hasattr(ref, "n_shared_experts"):
        assert ours.shared_expert_intermediate_size == ref.n_shared_experts * ours.moe_intermediate_size
    assert ours.nextn_layers == getattr(ref, "num_nextn_predict_layers", 0)    # stored past the layers, not served
    if hasattr(ref, "n_group") and ref.n_group and ours.num_groups > 1:
        assert (ours.num_groups, ours.topk_groups) == (ref.n_group, ref.topk_group)


@pytest.mark.parametrize("arch", sorted(ALWAYS_RENORMALISES))
def test_routers_that_always_renormalise_ignore_norm_topk_prob(arch):
    """transformers' Mixtral and MiniMax-M2 routers divide by the top-k sum whatever the config says (a config
    with norm_topk_prob false gave other tokens than transformers)."""
    for value in (False, True):
        assert ModelConfig.from_dict({**minimal(arch), "norm_topk_prob": value}).norm_topk_prob


@pytest.mark.parametrize("arch", sorted(CLASSES))
def test_an_activation_the_experts_do_not_compute_is_refused_naming_it(arch):
    for act in ("silu", "swish"):
        ModelConfig.from_dict({**minimal(arch), "hidden_act": act})
    if ARCHITECTURES[arch].clamped_swiglu:      # GPT-OSS's experts compute their clamped SwiGLU whatever it says
        ModelConfig.from_dict({**minimal(arch), "hidden_act": "gelu"})
        return
    for act in ("gelu", "gelu_pytorch_tanh", "relu"):
        with pytest.raises(ConfigError, match=f"hidden_act '{act}' is not one {arch} can serve; supported: silu"):
            ModelConfig.from_dict({**minimal(arch), "hidden_act": act})


@pytest.mark.parametrize("arch", ["OlmoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM"])
def test_an_explicit_null_of_kv_heads_is_every_head(arch):
    """transformers (4.x, and 5.x's OLMoE) reads "num_key_value_heads": null as plain multi-head attention; the
    class default must not fill it in."""
    assert ModelConfig.from_dict({**minimal(arch), "num_key_value_heads": None}).num_kv_heads == 32


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_the_stored_dtype_is_a_floating_torch_dtype_by_the_name_transformers_reads(key):
    """config.json's dtype as transformers takes it (getattr(torch, name)): its aliases are the saved names, and a
    name that is no dtype of saved weights is refused naming the key, where --dtype auto had served it as bfloat16
    (transformers refuses them too: "torch.bfloat16" has no getattr(torch, ...))."""
    import torch

    from colibri_common.options import serving_dtype

    base = minimal("Qwen3MoeForCausalLM")
    assert ModelConfig.from_dict(base).torch_dtype == "float32"              # none given: transformers 4's default
    for given, saved, auto in (("float", "float32", "float32"), ("half", "float16", "bfloat16"),
                               ("double", "float64", "float32"), ("bfloat16", "bfloat16", "bfloat16"),
                               ("float8_e4m3fn", "float8_e4m3fn", "bfloat16")):
        assert getattr(torch, given) == getattr(torch, saved)                     # as transformers reads it
        cfg = ModelConfig.from_dict({**base, key: given})
        assert cfg.torch_dtype == saved and serving_dtype("auto", cfg.torch_dtype) == auto
    for bad in ("bf16", "int8", "float4", "torch.bfloat16", 16, ["bfloat16"]):
        with pytest.raises(ConfigError, match=f"config.json: {key} .* is not a dtype a checkpoint's weights are "
                                              f"saved in; use one of bfloat16, float16, float32, float64, "
                                              f"float8_e4m3fn, "):
            ModelConfig.from_dict({**base, key: bad})


def test_a_config_that_names_no_dtype_is_served_in_its_weights_dtype_as_transformers_5_loads_it(oracles, tmp_path):
    """A bf16 checkpoint whose config.json names no dtype was taken as float32 (transformers 4's default), so
    --dtype auto held its weights at twice their size; transformers 5 loads it in its weights' dtype."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import torch

    src = oracles["qwen3_moe"]
    path = tmp_path / "bf16-no-dtype"
    transformers.AutoModelForCausalLM.from_pretrained(src.path, dtype=torch.bfloat16).save_pretrained(path)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("dtype", None)
    raw.pop("torch_dtype", None)
    (path / "config.json").write_text(json.dumps(raw))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)                 # the oracle's reading
    assert loaded.dtype == torch.bfloat16
    cfg = ModelConfig.from_dir(path)
    assert (cfg.torch_dtype, cfg.torch_dtype_from) == ("bfloat16", "the weights; config.json names none")
    assert ModelConfig.from_dir(src.path).torch_dtype_from == "config.json"
    (path / "stray.safetensors").write_bytes(b"not a safetensors file")     # passed over, not a float32 fallback
    assert ModelConfig.from_dir(path).torch_dtype == "bfloat16"
    (path / "stray.safetensors").unlink()
    colibri = str(Path(sys.executable).parent / "colibri")
    out = subprocess.run([colibri, "validate", "--model", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "stored dtype     bfloat16 (the weights; config.json names none); sized as served in bfloat16 " \
           "(--dtype auto)" in out.stdout, out.stdout
