"""FP8 checkpoints as published (block-scaled e4m3 weights with float32 `weight_scale_inv`): they dequantise
within e4m3's rounding and serve the tokens transformers gives on the dequantised model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from colibri_common.checkpoint import Checkpoint
from colibri_common.errors import CheckpointError, ConfigError
from kernels.formats.fp8 import dequantize, quantize
from tests.conftest import colibri_run, fleet
from tests.inprocess import InProcess
from tests.models import Oracle, build_model, save_checkpoint, small_config
from tests.test_e2e_oracle import check_against_oracle

BLOCK = (8, 32)            # smaller than the published 128 x 128, so these tiny weights span several blocks
                           # (and the expert width, 40, is whole blocks of rows: FP8 can be kept as published)


def test_dequantised_weights_are_within_e4m3_rounding():
    w = torch.randn(40, 70, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 70)  # [R, C]
    q, scale = quantize(w, BLOCK)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 3)
    back = dequantize(q, scale, BLOCK)                                                   # [R, C] float32
    s = scale.repeat_interleave(8, 0)[:40].repeat_interleave(32, 1)[:, :70]
    # e4m3 has 3 mantissa bits: a normal value rounds within 2^-4 of itself; subnormals (below 2^-6 x scale)
    # within half their 2^-9 x scale spacing
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2**-4, s * 2**-10) + 1e-12).all()
    assert not torch.equal(back, w)                                        # it did round
    with pytest.raises(ValueError, match="needs scales"):
        dequantize(q, scale[:2], BLOCK)


def fp8_checkpoint(src, dst) -> dict[str, torch.Tensor]:
    """`src` re-saved with every attention and expert weight as published FP8 (the gate, norms, embeddings
    and lm_head stay float); returns the dequantised values of what was quantised."""
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    out, deq = {}, {}
    for name, t in tensors.items():
        if name.endswith(".weight") and t.dim() == 2 and (".self_attn." in name or ".experts." in name):
            q, s = quantize(t, BLOCK)
            out[name], out[name + "_scale_inv"] = q, s
            deq[name] = dequantize(q, s, BLOCK)
        else:
            out[name] = t
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "float8_e4m3fn", "quant_method": "fp8",
                                  "weight_block_size": list(BLOCK),     # MiniMax-M2's, with smaller blocks
                                  "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return deq


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    """MiniMax-M2 (published in FP8, per-expert w1/w2/w3) and transformers on its dequantised weights."""
    root = tmp_path_factory.mktemp("fp8")
    src = save_checkpoint(build_model(small_config("minimax_m2"), seed=5), root / "float")
    deq = fp8_checkpoint(src, root / "fp8")
    # the oracle: transformers loading the same checkpoint with the dequantised values in float32
    plain = {}
    for f in sorted(src.glob("*.safetensors")):
        plain.update(load_file(f))
    (root / "deq").mkdir()
    save_file({**plain, **deq}, str(root / "deq" / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", root / "deq" / "config.json")
    model = AutoModelForCausalLM.from_pretrained(root / "deq", dtype=torch.float32).eval()
    return Oracle(model, root / "fp8")


def test_an_fp8_checkpoint_serves_transformers_tokens_on_its_dequantised_weights(fp8_model):
    prompt = [3, 17, 42, 99, 5, 8]
    with InProcess(fp8_model.path) as engine:
        res = engine.generate(prompt, 16, return_logits=True)
    check_against_oracle(fp8_model, prompt, res.token_ids, res.logits, res.finish_reason)


def test_a_fleet_serves_it_and_validate_reports_the_format(fp8_model):
    out = colibri_run(["validate", "--model", str(fp8_model.path)])
    assert out.returncode == 0, out.stderr
    assert "fp8 e4m3, 8x32 block scales" in out.stdout
    from colibri.client import Client

    with fleet(fp8_model.path, 2) as (addr, _):
        assert Client(addr).generate([1, 2, 3], 8).token_ids == fp8_model.greedy([1, 2, 3], 8)


def test_a_worker_keeps_the_experts_fp8_for_the_triton_kernels(fp8_model):
    """--quantized-experts keep: the published e4m3 values and block scales are what the worker holds (a third of the
    float32 bytes, plus scales), and the Triton kernels (run by the interpreter on CPU tensors, as a GPU would
    run them) scale each tile as they load it: transformers' tokens on the dequantised model."""
    from colibri.client import Client
    from tests.conftest import metrics, metrics_port

    env = {"COLIBRI_MOE_BACKEND": "triton", "TRITON_INTERPRET": "1"}
    port = metrics_port(1)
    with fleet(fp8_model.path, 1, ["--quantized-experts", "keep", "--metrics-port", str(port)], env=env) as (addr, _):
        prompt = [3, 17, 42, 99, 5, 8]
        res = Client(addr).generate(prompt, 6, return_logits=True)
        assert res.token_ids == fp8_model.greedy(prompt, 6)
        resident = metrics(port + 1)["colibri:expert_resident_bytes"]
    H, I, E, L = 96, 40, 8, 2
    scales = 4 * ((2 * I // 8) * (H // 32) + (H // 8) * -(-I // 32))
    assert resident == E * L * (3 * H * I + scales)                       # e4m3 values + float32 block scales


def test_keeping_fp8_on_a_cpu_without_the_triton_kernels_fails_at_start(fp8_model):
    out = colibri_run(["expert", "--model", str(fp8_model.path), "--shard", "0/1", "--quantized-experts", "keep"],
                      env={k: v for k, v in __import__("os").environ.items() if k != "COLIBRI_MOE_BACKEND"})
    assert out.returncode != 0
    assert "--quantized-experts keep on a CPU needs the Triton kernels" in out.stderr
    assert "Traceback" not in out.stderr


def test_fp8_weights_without_their_scales_or_format_are_named(fp8_model, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(fp8_model.path, bad)
    tensors = load_file(bad / "model.safetensors")
    victim = next(n for n in tensors if n.endswith("experts.3.w2.weight_scale_inv"))
    tensors[victim] = tensors[victim][:1]                                   # a scale grid of the wrong shape
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    out = colibri_run(["validate", "--model", str(bad)])
    assert out.returncode != 0 and victim in out.stderr and "Traceback" not in out.stderr, out.stderr
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="compressed-tensors"):
        Checkpoint(bad)
    ckpt = Checkpoint(fp8_model.path)
    name = next(n for n in ckpt.entries if n.endswith("q_proj.weight"))
    assert ckpt.tensor(name).dtype == torch.float32
    ckpt.fp8 = None                                   # as if config.json had no quantization_config
    with pytest.raises(CheckpointError, match="no fp8 quantization_config"):
        ckpt.tensor(name)
    ckpt.close()


def test_kernels_that_cannot_run_on_the_device_fail_at_start_not_at_the_first_request(fp8_model, monkeypatch):
    """A worker runs one token through its fused-MoE kernels before it is ready (on a GPU, Triton compiles them
    then): a compiler's or device's refusal becomes one clear start-up error naming the weights and device."""
    from colibri_common.config import ModelConfig
    from colibri_common.errors import ConfigError
    from expert_service import shard as shard_module

    ckpt = Checkpoint(fp8_model.path)
    experts = shard_module.ExpertShard(ModelConfig.from_dir(fp8_model.path), ckpt, 0, 1, torch.float32)
    experts.warm_up()                                                    # runs: nothing raised
    monkeypatch.setattr(shard_module, "fused_moe", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("CompilationError: type fp8e4nv not supported in this architecture")))
    with pytest.raises(ConfigError, match=r"kernels \(float32 weights\) cannot run on cpu: .*fp8e4nv not supported"):
        experts.warm_up()
    experts.close()


def test_experts_left_unquantised_in_some_layers_are_dequantised_with_the_rest(fp8_model, tmp_path):
    """A checkpoint whose last MoE layer's experts stayed bf16 (modules_to_not_convert): the format is kept for
    all the experts or for none. `auto` chose from the first layer's expert 0 alone, so an FP8 GPU would keep FP8
    and then refuse the bf16 layer; `keep` now says which tensor is not FP8."""
    from colibri_common.config import ModelConfig
    from expert_service.kept_format import kept_format

    tensors = load_file(fp8_model.path / "model.safetensors")
    cfg = ModelConfig.from_dir(fp8_model.path)
    last = f"model.layers.{cfg.moe_layers[-1]}."
    for name in [n for n in tensors if n.startswith(last) and ".experts." in n and n.endswith(".weight")]:
        tensors[name] = dequantize(tensors[name], tensors.pop(name + "_scale_inv"), BLOCK).to(torch.bfloat16)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    save_file(tensors, str(mixed / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(fp8_model.path / "config.json", mixed / "config.json")
    ckpt = Checkpoint(mixed)
    assert kept_format(cfg, ckpt, torch.device("cuda"), "auto", None) is None     # no GPU asked: decided before
    with pytest.raises(ConfigError, match=rf"'{last}.*' \(BF16\) is not stored as the first MoE layer's experts"):
        kept_format(cfg, ckpt, torch.device("cpu"), "keep", None)
