"""GPT-OSS beyond the shared oracle checks (tests/test_e2e_oracle.py): MXFP4 experts as published, sliding
windows over cached context (chunked prefill, prefix cache), the expert cache with the experts' biases,
Mixtral's all-layers sliding window, and configs that cannot be served.

The MXFP4 oracle is transformers on the model whose experts transformers' own MXFP4 dequantiser
(integrations.mxfp4.convert_moe_packed_tensors) produced from the checkpoint's blocks and scales.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from colibri.validate import validate
from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.errors import CheckpointError, ConfigError
from kernels import mxfp4
from router_service.engine.scheduler import SchedulerConfig
from tests.inprocess import InProcess
from tests.models import Oracle, build_model, save_checkpoint, small_config
from tests.test_e2e_oracle import NEW_TOKENS, PROMPTS, check_against_oracle

LONG = [(11 * j + 5) % 256 for j in range(30)]          # far past the window of 4


def write_mxfp4(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """`src`'s GPT-OSS checkpoint with its experts in MXFP4 as published: `*_blocks` / `*_scales` per layer,
    biases and every other tensor as they were, quantization_config mxfp4. Returns the blocks and scales."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    packed = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).transpose(1, 2).contiguous()          # [E, out, in]: the blocks run along inputs
        packed[name + "_blocks"], packed[name + "_scales"] = mxfp4.quantize(w)
    save_file({**tensors, **packed}, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return packed


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Oracle:
    model = build_model(small_config("gpt_oss"), seed=21)
    return Oracle(model, save_checkpoint(model, tmp_path_factory.mktemp("gpt_oss") / "ckpt"))


@pytest.fixture(scope="module")
def mxfp4_oracle(tmp_path_factory) -> tuple[Oracle, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An MXFP4 GPT-OSS checkpoint, transformers on its experts as transformers dequantises them, the original
    float weights and the blocks / scales."""
    root = tmp_path_factory.mktemp("mxfp4")
    model = build_model(small_config("gpt_oss", intermediate_size=64), seed=5)   # widths of whole 32-blocks
    original = {k: v.clone() for k, v in model.state_dict().items()}
    packed = write_mxfp4(save_checkpoint(model, root / "bf"), root / "mxfp4")
    state = model.state_dict()
    for name in [n for n in packed if n.endswith("_blocks")]:
        weight = name.removesuffix("_blocks")
        state[weight] = convert_moe_packed_tensors(packed[name], packed[weight + "_scales"], dtype=torch.float32)
    model.load_state_dict(state)
    return Oracle(model, root / "mxfp4"), original, packed


def test_mxfp4_experts_dequantise_within_the_format_and_serve_as_transformers(mxfp4_oracle):
    oracle, original, packed = mxfp4_oracle
    ckpt = Checkpoint(oracle.path)
    assert ckpt.quantized() == {"mxfp4 e2m1, 32-value blocks with e8m0 scales": 4}
    state = oracle.model.state_dict()                                # transformers' dequantised experts
    for layer in range(2):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            ours = ckpt.mxfp4(name + "_blocks", name + "_scales")                    # [E, out, in]
            assert torch.equal(ours.transpose(1, 2), state[name])
            # within the format's rounding: half a step of e2m1 at the block's scale, or the clip to 6 x scale
            step = torch.pow(2.0, packed[name + "_scales"].float() - 127).repeat_interleave(32, -1)
            err = (ours - original[name].transpose(1, 2)).abs()                      # [E, out, in]
            assert (err <= 2 * step).all() and err.mean() < 0.25 * step.mean()
    ckpt.close()
    with InProcess(oracle.path) as engine:
        for prompt in PROMPTS:
            res = engine.generate(prompt, NEW_TOKENS, return_logits=True)
            check_against_oracle(oracle, prompt, res.token_ids, res.logits, res.finish_reason)
    lines = validate(str(oracle.path), workers=2)
    assert any("mxfp4 e2m1" in line for line in lines), lines
    params = sum(p.numel() for p in oracle.model.parameters()) / 1e6   # MXFP4 counts its values, not its bytes
    assert any(line.startswith(f"parameters       {params:.1f}M") for line in lines), (params, lines)
    assert any(line.startswith("attention") and "sinks, sliding window 4 on 1 of 2 layers" in line for line in lines)


def test_a_worker_keeps_the_mxfp4_experts_for_the_triton_kernels(mxfp4_oracle):
    """--quantized-experts keep: the worker holds the published blocks and scales (4.25 bits a weight) and the
    Triton kernels (the interpreter on CPU tensors, as a GPU runs them) decode each tile as they load it:
    transformers' tokens on the dequantised model."""
    from colibri.client import Client
    from tests.conftest import fleet, metrics, metrics_port

    oracle = mxfp4_oracle[0]
    port = metrics_port(1)
    env = {"COLIBRI_MOE_BACKEND": "triton", "TRITON_INTERPRET": "1"}
    extra = ["--quantized-experts", "keep", "--metrics-port", str(port)]
    with fleet(oracle.path, 1, extra, env=env) as (addr, _):
        res = Client(addr).generate(PROMPTS[0], 6)
        assert res.token_ids == oracle.greedy(PROMPTS[0], 6)
        resident = metrics(port + 1)["colibri:expert_resident_bytes"]
    H, I, E, L = 96, 64, 8, 2
    assert resident == E * L * (3 * H * I // 2 + 3 * H * I // 32)       # nibbles + one scale byte per 32


def test_a_damaged_mxfp4_checkpoint_fails_at_start_naming_the_tensor(tmp_path):
    model = build_model(small_config("gpt_oss", intermediate_size=64), seed=5)
    write_mxfp4(save_checkpoint(model, tmp_path / "bf"), tmp_path / "mxfp4")
    tensors = load_file(tmp_path / "mxfp4" / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][:, :, :1].contiguous()                  # scales for one block of two
    save_file(tensors, tmp_path / "mxfp4" / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.experts.down_proj_scales' has shape"):
        InProcess(tmp_path / "mxfp4")


def test_sliding_windows_over_cached_context(gpt_oss):
    """Chunked prefill (queries over cached keys, part of them out of the window) and decode batched with
    prefill give transformers' tokens."""
    with InProcess(gpt_oss.path, sched=SchedulerConfig(max_num_tokens=8)) as engine:
        res = engine.generate(LONG, NEW_TOKENS, return_logits=True)
        check_against_oracle(gpt_oss, LONG, res.token_ids, res.logits, res.finish_reason)
        outs = engine.submit_all([LONG, PROMPTS[0], PROMPTS[2]], NEW_TOKENS)   # one batch, mixed steps
        for prompt, out in zip((LONG, PROMPTS[0], PROMPTS[2]), outs, strict=True):
            assert engine.collect(out).token_ids == gpt_oss.greedy(prompt, NEW_TOKENS)


def test_the_expert_cache_carries_the_experts_biases(gpt_oss):
    """Two hot slots a layer for top-3 routing: every call runs in rounds, each slot's biases its expert's."""
    with InProcess(gpt_oss.path, expert_cache_capacity="2") as engine:
        res = engine.generate(PROMPTS[0], NEW_TOKENS, return_logits=True)
        check_against_oracle(gpt_oss, PROMPTS[0], res.token_ids, res.logits, res.finish_reason)
        assert engine.shard.cache is not None and engine.shard.cache.stats.evictions > 0


def test_mixtral_with_a_sliding_window_on_every_layer(tmp_path):
    model = build_model(small_config("mixtral", sliding_window=5), seed=3)
    oracle = Oracle(model, save_checkpoint(model, tmp_path / "mixtral"))
    assert ModelConfig.from_dir(oracle.path).sliding_layers == (0, 1)
    with InProcess(oracle.path, sched=SchedulerConfig(max_num_tokens=8)) as engine:
        res = engine.generate(LONG, NEW_TOKENS, return_logits=True)
        check_against_oracle(oracle, LONG, res.token_ids, res.logits, res.finish_reason)


def test_norms_kept_in_float32_scale_before_the_cast_as_transformers():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    from router_service.model.layers import rms_norm, rms_norm_torch

    norm = GptOssRMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(96))
    x = torch.randn(5, 96).bfloat16()
    assert torch.equal(rms_norm_torch(x, norm.weight.detach(), 1e-5), norm(x))
    # the native op (where built) sums the squares in float64, torch in float32: the same up to one bf16 rounding
    torch.testing.assert_close(rms_norm(x, norm.weight.detach(), 1e-5), norm(x), atol=0, rtol=2**-8)


def test_int8_experts_with_biases_serve(gpt_oss):
    with InProcess(gpt_oss.path, quantize="int8") as engine:
        res = engine.generate(PROMPTS[0], 4, return_logits=True)
    want = gpt_oss.last_logits(PROMPTS[0])
    assert float((res.logits[0] - want).abs().max() / want.abs().max()) < 5e-2      # int8's rounding


def test_generation_config_stop_tokens_join_the_eos(gpt_oss, tmp_path):
    """The published GPT-OSS stops on <|return|> (config.json) and on <|call|> and <|endoftext|>
    (generation_config.json), as transformers' generate() does."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(gpt_oss.path, ckpt)
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, "eos_token_id": 200}))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [200, 199, 201]}))
    assert ModelConfig.from_dir(ckpt).eos_token_ids == (200, 199, 201)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(ConfigError, match="eos_token_id must be a token id"):
        ModelConfig.from_dir(ckpt)


@pytest.mark.parametrize(("change", "message"), [
    ({"layer_types": ["sliding_attention"]}, "layer_types must list 2 kinds"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "each one of sliding_attention, full_attention"),
    ({"sliding_window": 0}, "sliding_window is 0"),
])
def test_gpt_oss_configs_that_cannot_be_served_name_the_field(gpt_oss, tmp_path, change, message):
    bad = tmp_path / "bad"
    shutil.copytree(gpt_oss.path, bad)
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dir(bad)


def test_an_mxfp4_scale_that_the_format_calls_nan_fails_at_start_naming_the_tensors(tmp_path):
    """A scale byte of 255 (NaN in the MX format) dequantised to 2^128 = inf: start-up passed and the first request
    failed on non-finite logits."""
    model = build_model(small_config("gpt_oss", intermediate_size=64), seed=5)
    write_mxfp4(save_checkpoint(model, tmp_path / "bf"), tmp_path / "mxfp4")
    tensors = load_file(tmp_path / "mxfp4" / "model.safetensors")
    name = "model.layers.0.mlp.experts.gate_up_proj_scales"
    tensors[name][1, 3, 0] = 255
    save_file(tensors, tmp_path / "mxfp4" / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"'model.layers.0.mlp.experts.gate_up_proj_blocks' and '{name}': an "
                                              r"MXFP4 scale byte is 255, which the MX format defines as NaN"):
        InProcess(tmp_path / "mxfp4")
