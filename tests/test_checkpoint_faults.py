"""Checkpoints that are odd or damaged in ways a probe found served without a word, or with a traceback: each is
now read as transformers reads it (the oracle), or refused at start with one line that names the file and what to
fix. The safetensors files' own damage is tests/test_checkpoint_offsets.py's."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from colibri_common.architectures import ARCHITECTURES
from colibri_common.chat_template import ChatTemplate, TemplateBroken, load_chat_template
from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.errors import CheckpointError, ConfigError
from colibri_common.fp8 import Fp8Format
from colibri_common.tensors import unused_tensors
from tests.inprocess import InProcess
from tests.test_config_defaults import CLASSES, minimal

COLIBRI = str(Path(sys.executable).parent / "colibri")


def copy_of(src: Path, dst: Path) -> Path:
    """A checkpoint whose files are links to `src`'s, its JSON files copies (to be edited)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".json" or f.suffix == ".jinja":
            shutil.copy(f, dst / f.name)
        else:
            (dst / f.name).symlink_to(f)
    return dst


def edit(path: Path, **changes) -> None:
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([COLIBRI, "validate", "--model", str(path)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("top_theta", [None, 7777.0])
def test_rope_scaling_takes_rope_parameters_place_as_transformers_reads_it(arch, top_theta):
    """transformers 5 saves rope_parameters in every config; a long-context recipe then adds rope_scaling. It is the
    one transformers uses (rope_theta then the top level's or the class's default, not rope_parameters'), where
    Colibri had kept rope_parameters and served the unscaled model."""
    raw = minimal(arch) | {"rope_parameters": {"rope_theta": 123456.0, "rope_type": "default"},
                           "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    if top_theta is not None:
        raw["rope_theta"] = top_theta
    ref = getattr(transformers, CLASSES[arch]).from_dict({k: v for k, v in raw.items() if k != "architectures"})
    ours = ModelConfig.from_dict(raw)
    assert (ours.rope_scaling.type, ours.rope_scaling.factor) == ("linear", 4.0) == \
        (ref.rope_parameters["rope_type"], ref.rope_parameters["factor"])
    assert ours.rope_theta == ref.rope_parameters["rope_theta"] != 123456.0


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}


def transformers_config(arch: str, raw: dict) -> transformers.PretrainedConfig:
    """transformers' reading of `raw`, rope parameters standardised as its rotary embedding reads them."""
    ref = getattr(transformers, CLASSES[arch]).from_dict(json.loads(json.dumps(
        {k: v for k, v in raw.items() if k != "architectures"})))
    ref.standardize_rope_params()
    return ref


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"])
@pytest.mark.parametrize("top,rope", [
    (512, YARN | {"original_max_position_embeddings": 1024}),   # the top level's wins (where Phi-3 keeps it)
    (None, YARN | {"original_max_position_embeddings": 1024}),
    (None, YARN),                                                # max_position_embeddings
    (1024, YARN | {"factor": None}),                             # DeepSeek's ratio of the lengths, from the top's
])
def test_yarn_reads_the_pretraining_length_where_transformers_does(arch, top, rope):
    """A config with original_max_position_embeddings at its top level as well as in its rope dict: transformers
    uses the top level's, Colibri had used the dict's (other frequencies, other tokens)."""
    raw = minimal(arch) | {"max_position_embeddings": 4096, "rope_scaling": rope}
    if top is not None:
        raw["original_max_position_embeddings"] = top
    ref = transformers_config(arch, raw).rope_parameters
    ours = ModelConfig.from_dict(raw).rope_scaling
    assert ours.original_max_position_embeddings == ref["original_max_position_embeddings"]
    assert ours.factor == (ref["factor"] or 4096 / ref["original_max_position_embeddings"])


@pytest.mark.parametrize("rope,needle", [
    ({"rope_type": "yarn", "original_max_position_embeddings": 1024}, "rope_scaling of type 'yarn' needs a 'factor'"),
    ({"rope_type": "linear"}, "rope_scaling of type 'linear' needs a 'factor'"),
    ({"rope_type": "dynamic", "factor": None}, "rope_scaling of type 'dynamic' needs a 'factor'"),
    (YARN | {"original_max_position_embeddings": 0},
     "rope_scaling.original_max_position_embeddings must be a whole number from 1"),
])
def test_rope_configs_transformers_refuses_are_refused_naming_the_key(rope, needle):
    """yarn without a factor, or with a pretraining length of 0, was served (a factor guessed from the lengths, or
    max_position_embeddings taken for the 0) where transformers refuses the config."""
    raw = minimal("Qwen3MoeForCausalLM") | {"max_position_embeddings": 4096, "rope_scaling": rope}
    with pytest.raises((KeyError, ZeroDivisionError, TypeError)):
        transformers_config("Qwen3MoeForCausalLM", raw)
        transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS.get(rope["rope_type"], lambda *_: None)(
            transformers_config("Qwen3MoeForCausalLM", raw), "cpu")
    with pytest.raises(ConfigError, match=needle):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("key,value", [("rope_theta", 0), ("rope_theta", -5.0), ("rope_theta", math.nan),
                                       ("rms_norm_eps", -1.0), ("rms_norm_eps", 0), ("rms_norm_eps", math.inf),
                                       ("rope_scaling", {"rope_type": "linear", "factor": 0})])
def test_values_that_make_every_request_non_finite_are_refused_naming_the_key(key, value):
    """rope_theta 0 or NaN, or a negative eps, passed the checks and every request then failed with non-finite
    logits, naming nothing."""
    raw = minimal("Qwen3MoeForCausalLM") | {key: value}
    with pytest.raises(ConfigError, match="rope scaling factor must be positive" if key == "rope_scaling" else
                       key + " must be a positive number"):
        ModelConfig.from_dict(raw)


def test_unreadable_json_files_are_one_line_errors_not_tracebacks(oracles, tmp_path):
    """config.json or generation_config.json not UTF-8, a config.json nested past the parser, and a
    quantization_config that is not an object: each one line naming the file (they were tracebacks)."""
    src = oracles["qwen3_moe"].path
    path = copy_of(src, tmp_path / "ckpt")
    config = (path / "config.json").read_bytes()
    (path / "config.json").write_bytes(config.replace(b'"architectures"', b'"architectures\xe9"'))
    with pytest.raises(ConfigError, match="config.json: not UTF-8 text"):
        ModelConfig.from_dir(path)
    (path / "config.json").write_bytes(b"[" * 100_000)
    with pytest.raises(ConfigError, match="nests too deeply"):
        ModelConfig.from_dir(path)
    assert Fp8Format.from_dir(path) is None                  # (config.json's own loader says what is wrong)
    (path / "config.json").write_bytes(config)
    (path / "generation_config.json").write_bytes(b'{"eos_token_id": 1, "x": "\xff"}')
    with pytest.raises(ConfigError, match="generation_config.json: not UTF-8 text"):
        ModelConfig.from_dir(path)
    (path / "generation_config.json").unlink()
    edit(path / "config.json", quantization_config="fp8")
    with pytest.raises(CheckpointError, match="quantization_config must be a JSON object"):
        Fp8Format.from_dir(path)
    out = validate(path)
    assert out.returncode == 2 and "quantization_config must be a JSON object" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_tensor_stored_in_two_files_is_refused_without_an_index_and_taken_from_the_indexed_file(oracles, tmp_path):
    """Without an index every *.safetensors is read, and a second file holding lm_head.weight silently won (by
    sorted name); with an index, the file it names is the one read."""
    src = oracles["qwen3_moe"].path
    path = copy_of(src, tmp_path / "ckpt")
    stored = Checkpoint(src)
    head = stored.entries["lm_head.weight"]
    other = torch.randn(*head.shape).to(torch.float32 if head.dtype == "F32" else torch.bfloat16)
    save_file({"lm_head.weight": other}, str(path / "zz-extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' is stored in both .* and zz-extra.safetensors"):
        Checkpoint(path)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    weights = {name: e.file.name for name, e in stored.entries.items()}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weights | {
        "lm_head.weight": weights["lm_head.weight"]}}))
    assert "zz-extra.safetensors" in files and "zz-extra.safetensors" not in weights.values()
    got = Checkpoint(path)
    assert got.entries["lm_head.weight"].file.name == weights["lm_head.weight"]
    # an index that names the extra file for it reads that one
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weights | {
        "lm_head.weight": "zz-extra.safetensors"}}))
    assert Checkpoint(path).entries["lm_head.weight"].file.name == "zz-extra.safetensors"
    # an index that names the wrong one of its files for a tensor stored once is read as transformers reads it
    (path / "zz-extra.safetensors").unlink()
    save_file({"unused.weight": torch.zeros(2)}, str(path / "zz-extra.safetensors"))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weights | {
        "lm_head.weight": "zz-extra.safetensors", "unused.weight": "zz-extra.safetensors"}}))
    assert Checkpoint(path).entries["lm_head.weight"].file.name == weights["lm_head.weight"]
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weights | {
        "missing.weight": "zz-extra.safetensors"}}))
    with pytest.raises(CheckpointError, match="'missing.weight' is listed in zz-extra.safetensors but stored in none"):
        Checkpoint(path)


def test_a_stored_lm_head_is_used_where_config_says_tied_as_transformers_loads_it(oracles, tmp_path):
    """tie_word_embeddings true over a checkpoint that stores its own lm_head: transformers uses the stored head
    (it does not tie a head it was given); Colibri had served the embeddings as the head, other tokens."""
    src = oracles["qwen3_moe"].path
    assert not ModelConfig.from_dir(src).tie_word_embeddings
    path = copy_of(src, tmp_path / "tied")
    edit(path / "config.json", tie_word_embeddings=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert not torch.equal(theirs.lm_head.weight, theirs.model.embed_tokens.weight)
    assert not ModelConfig.from_dir(path).tie_word_embeddings
    prompt = [3, 14, 15, 92, 65]
    with torch.no_grad():
        want = theirs.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    with InProcess(path, dtype="float32", cpu_forms="off") as engine:
        assert engine.collect(engine.submit(prompt, 6)).token_ids == want


def test_qwen2_moe_shared_expert_width_as_transformers(oracles, tmp_path):
    """A config that leaves shared_expert_intermediate_size out takes transformers' default (it was 0: the shared
    expert dropped silently); 0 over a checkpoint that stores the shared expert is refused, as transformers does."""
    raw = minimal("Qwen2MoeForCausalLM")
    assert ModelConfig.from_dict(raw).shared_expert_intermediate_size == \
        transformers.Qwen2MoeConfig().shared_expert_intermediate_size
    path = copy_of(oracles["qwen2_moe"].path, tmp_path / "ckpt")
    assert ModelConfig.from_dir(path).shared_expert_intermediate_size > 0
    edit(path / "config.json", shared_expert_intermediate_size=0)
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size is 0, but the checkpoint stores shared"):
        ModelConfig.from_dir(path)


def test_a_chat_template_that_does_not_compile_is_the_checkpoints_fault(oracles, tmp_path):
    """A template with a syntax error was found only by each chat request, answered 400 as if the messages were
    wrong; validate now refuses it, and the front's answer (500) names the checkpoint. A template not UTF-8 was a
    traceback at the router's start."""
    from tests.chat_fixtures import chat_checkpoint

    path = chat_checkpoint(tmp_path / "chat")[0].path
    assert validate(path).returncode == 0
    (path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    out = validate(path)
    assert out.returncode == 2 and "the chat template does not compile" in out.stderr, out.stderr
    template, special = load_chat_template(path)
    with pytest.raises(TemplateBroken, match="a fault of the checkpoint, not of the request"):
        ChatTemplate(template or "", special).render([{"role": "user", "content": "hi"}])
    from colibri_common.chat_template import compile_error

    assert compile_error("{% for m in messages %}" * 30 + "x" + "{% endfor %}" * 30)   # Python's refusal, not raised
    (path / "chat_template.jinja").write_bytes(b"{{ messages[0].content }}\xe9")
    with pytest.raises(CheckpointError, match="chat_template.jinja: not UTF-8 text"):
        load_chat_template(path)


def test_an_unreadable_tokenizer_is_a_permission_error_not_a_bad_file(oracles, tmp_path):
    """tokenizer.json this process may not read was reported as a broken file to replace; it is a permission
    error naming the file and the uid (as every other checkpoint file's). As root, run with DAC override dropped."""
    from tests.chat_fixtures import chat_checkpoint

    prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    if os.geteuid() != 0 or shutil.which("setpriv") is None or subprocess.run([*prefix, "true"]).returncode != 0:
        pytest.skip("needs root and setpriv to take away root's access to a file")
    path = chat_checkpoint(tmp_path / "chat")[0].path
    (path / "tokenizer.json").chmod(0)
    out = subprocess.run([*prefix, COLIBRI, "validate", "--model", str(path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "tokenizer.json: permission denied for this process" in out.stderr, out.stderr
    assert "replace the file" not in out.stderr


@pytest.mark.parametrize("arch,change", [
    ("qwen3_moe", lambda cfg: {"num_hidden_layers": cfg["num_hidden_layers"] - 1}),   # a truncated config
    ("qwen2_moe", lambda cfg: {"qkv_bias": False}),                                   # biases stored, turned off
    ("glm4_moe", lambda cfg: {"use_qk_norm": False}),                                 # qk-norm stored, turned off
])
def test_tensors_the_config_leaves_unread_are_those_transformers_reports(oracles, tmp_path, caplog, arch, change):
    """A config.json that turns off what the checkpoint stores was served without a word (transformers warns, and
    lists them as unexpected keys): `validate` names them and the router's start warns."""
    path = copy_of(oracles[arch].path, tmp_path / "ckpt")
    edit(path / "config.json", **change(json.loads((path / "config.json").read_text())))
    _, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info["unexpected_keys"] and not info["missing_keys"]
    unused, nextn = unused_tensors(ModelConfig.from_dir(path), Checkpoint(path).entries.keys())
    experts = lambda names: {re.sub(r"experts\..*", "experts", n) for n in names}   # noqa: E731 (transformers
    assert experts(unused) == experts(info["unexpected_keys"]) and not nextn          # names them fused)
    out = validate(path)
    assert out.returncode == 0, out.stderr
    assert f"unused tensors   {len(unused)} that config.json leaves unread ({unused[0]}, " in out.stdout, out.stdout
    with caplog.at_level("WARNING", logger="colibri.router"), InProcess(path):
        pass
    assert f"{len(unused)} stored tensors that config.json leaves unread ({unused[0]}" in caplog.text


def test_every_stored_tensor_is_read_in_each_architecture_and_format(oracles, tmp_path):
    """Nothing is reported unused where everything is read: every architecture's checkpoint as transformers saves
    it, FP8 with block scales, GPT-OSS's MXFP4 blocks and scales; next-token prediction layers are apart."""
    from tests.models import build_model, save_checkpoint, small_config
    from tests.test_fp8 import fp8_checkpoint
    from tests.test_gpt_oss import write_mxfp4

    paths = [o.path for o in oracles.values()]
    fp8_checkpoint(oracles["minimax_m2"].path, tmp_path / "fp8")
    gpt_oss = build_model(small_config("gpt_oss", intermediate_size=64))     # widths of whole 32-blocks
    write_mxfp4(save_checkpoint(gpt_oss, tmp_path / "gpt_oss"), tmp_path / "mxfp4")
    for path in [*paths, tmp_path / "fp8", tmp_path / "mxfp4"]:
        cfg, ckpt = ModelConfig.from_dir(path), Checkpoint(path)
        assert unused_tensors(cfg, ckpt.entries.keys()) == ([], []), path
    # DeepSeek-V3's next-token prediction layer, stored past num_hidden_layers as published
    path = copy_of(oracles["deepseek_v3"].path, tmp_path / "mtp")
    raw = json.loads((path / "config.json").read_text())
    edit(path / "config.json", num_hidden_layers=raw["num_hidden_layers"] - 1, num_nextn_predict_layers=1)
    unused, nextn = unused_tensors(ModelConfig.from_dir(path), Checkpoint(path).entries.keys())
    last = f"model.layers.{raw['num_hidden_layers'] - 1}."
    assert unused == [] and nextn and all(n.startswith(last) for n in nextn)
    assert "multi-token prediction layer(s) past num_hidden_layers (not served)" in validate(path).stdout


def test_a_layer_whose_experts_are_half_fused_is_named_as_such(oracles, tmp_path):
    """gate_up stored fused (a half-done conversion) beside per-expert down projections was reported as a missing
    fused down_proj, which the checkpoint never meant to have."""
    path = copy_of(oracles["qwen3_moe"].path, tmp_path / "ckpt")
    (path / "model.safetensors").unlink()
    t = load_file(oracles["qwen3_moe"].path / "model.safetensors")
    p = "model.layers.1.mlp.experts."
    E = sum(1 for n in t if n.startswith(p) and n.endswith(".gate_proj.weight"))
    t[p + "gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{p}{e}.gate_proj.weight"), t.pop(f"{p}{e}.up_proj.weight")])
                                         for e in range(E)])
    save_file(t, path / "model.safetensors")
    out = validate(path)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"layer 1 stores its experts' gate and up fused ('{p}gate_up_proj') but their down projections one per " \
           f"expert ('{p}0.down_proj.weight')" in out.stderr, out.stderr


@pytest.mark.parametrize("value", [1e9, -1, 2.5, "one", True])
def test_a_next_token_layer_count_that_cannot_be_is_refused_naming_the_key(value):
    """num_nextn_predict_layers 1e9 had the router's start build a billion layer names (it hung); -1 was 0."""
    raw = minimal("DeepseekV3ForCausalLM") | {"num_nextn_predict_layers": value}
    with pytest.raises(ConfigError, match="num_nextn_predict_layers must be a whole number from 0 to "
                                          "num_hidden_layers"):
        ModelConfig.from_dict(raw)
    assert ModelConfig.from_dict(minimal("DeepseekV3ForCausalLM")).nextn_layers == 1       # transformers' default
