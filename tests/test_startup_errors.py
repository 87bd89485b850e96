"""A bad checkpoint is a clear start-up error naming the problem and the file, with a non-zero exit."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels import native
from tests.conftest import colibri_popen, colibri_run


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return colibri_run(list(args), timeout=timeout)


@pytest.fixture
def ckpt(oracles, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(oracles["qwen3_moe"].path, dst)
    return dst


def test_validate_accepts_a_good_checkpoint(ckpt):
    out = run("validate", "--model", str(ckpt), "--workers", "3")
    assert out.returncode == 0, out.stderr
    assert "Qwen3MoeForCausalLM" in out.stdout
    assert "worker 2/3" in out.stdout and "experts 40..59" in out.stdout
    assert "this CPU " in out.stdout and "ATen " in out.stdout and "CPU forms" in out.stdout
    q8 = run("validate", "--model", str(ckpt), "--workers", "3", "--quantize", "w8a8")
    assert q8.returncode == 0, q8.stderr
    assert "per-token int8 activations (--quantize w8a8)" in q8.stdout

    def shard_mib(text: str) -> float:
        return float(next(line for line in text.splitlines() if line.startswith("worker 2/3")).split()[-2])

    assert shard_mib(q8.stdout) < 0.3 * shard_mib(out.stdout)           # int8 + scales vs the stored float32


def test_dtype_auto_serves_a_bf16_checkpoint_at_its_size_and_validate_says_so(tmp_path):
    """The default --dtype is the checkpoint's (as vLLM's auto): a bfloat16 checkpoint was served in float32 by
    default, its experts packed at twice their size, while validate printed the stored size."""
    import torch

    from colibri_common.options import serving_dtype
    from expert_service.build import build_shard
    from expert_service.options import ExpertOptions
    from tests.models import build_model, save_checkpoint, small_config

    path = save_checkpoint(build_model(small_config("qwen3_moe"), seed=5).to(torch.bfloat16), tmp_path / "bf16")
    assert serving_dtype("auto", "bfloat16") == "bfloat16" and serving_dtype("auto", "float32") == "float32"
    assert serving_dtype("auto", "float16") == "bfloat16" and serving_dtype("float32", "bfloat16") == "float32"

    def shard_mib(*extra: str) -> float:
        out = run("validate", "--model", str(path), "--workers", "2", *extra)
        assert out.returncode == 0, out.stderr
        return float(next(line for line in out.stdout.splitlines() if line.startswith("worker 1/2")).split()[-2])

    assert shard_mib("--dtype", "float32") == pytest.approx(2 * shard_mib(), rel=0.01)
    built = build_shard(ExpertOptions(model=str(path), shard="1/2", cache=dataclasses.replace(
        ExpertOptions().cache, experts_in_place="off")), torch.device("cpu"))
    try:
        assert built.experts.dtype == torch.bfloat16                 # the default: as the checkpoint
        assert built.experts.packed_bytes / 2**20 == pytest.approx(shard_mib(), rel=0.05)
    finally:
        built.close()


def test_a_step_whose_moe_sums_would_not_fit_a_message_is_refused_at_start(ckpt):
    out = run("router", "--model", str(ckpt), "--workers", "127.0.0.1:9", "--max-num-tokens", "1000000",
              "--port", "0")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "--max-num-tokens 1000000" in out.stderr and "message limit" in out.stderr and "lower it to" in out.stderr


def test_a_config_that_is_not_an_object_is_one_line(ckpt, tmp_path):
    dst = tmp_path / "list"
    shutil.copytree(ckpt, dst)
    (dst / "config.json").write_text("[1, 2]")
    out = run("validate", "--model", str(dst))
    assert out.returncode == 2 and "must hold a JSON object (a model's config), not a list" in out.stderr
    assert "Traceback" not in out.stderr


def test_unknown_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GrokForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    for args in (["validate", "--model", str(ckpt)], ["serve", "--model", str(ckpt), "--port", "0"]):
        out = run(*args)
        assert out.returncode != 0
        assert "unsupported architecture ['GrokForCausalLM']" in out.stderr
        assert "config.json" in out.stderr


@pytest.mark.parametrize("victim", ["model.layers.1.self_attn.o_proj.weight",
                                    "model.layers.0.mlp.experts.59.down_proj.weight"])
def test_missing_tensor(ckpt, victim):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors[victim]
    save_file(tensors, ckpt / "model.safetensors")
    out = run("validate", "--model", str(ckpt))
    assert out.returncode != 0 and f"missing tensor '{victim}'" in out.stderr
    out = run("serve", "--model", str(ckpt), "--workers", "1", "--port", "0")
    assert out.returncode != 0 and f"missing tensor '{victim}'" in out.stderr   # the child's error, reported
    if ".experts." in victim:        # a worker that packs lazily still checks every tensor before ready
        out = run("expert", "--model", str(ckpt), "--shard", "1/2", "--port", "0", "--expert-cache-capacity", "1")
        assert out.returncode != 0 and f"missing tensor '{victim}'" in out.stderr


def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    for args in (["validate", "--model", str(ckpt)], ["expert", "--model", str(ckpt), "--shard", "0/2", "--port", "0"]):
        out = run(*args)
        assert out.returncode != 0
        assert "truncated" in out.stderr and str(f) in out.stderr


def test_bad_shard_flag(ckpt):
    out = run("expert", "--model", str(ckpt), "--shard", "2/2", "--port", "0")
    assert out.returncode != 0 and "--shard 2/2: need 0 <= I < N" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: --device cuda is valid here")
@pytest.mark.parametrize("args", [["expert", "--shard", "0/2", "--device", "cuda"],
                                  ["router", "--workers", "127.0.0.1:1", "--device", "cuda:0"],
                                  ["serve", "--workers", "1", "--gpus", "0,1"]])
def test_a_gpu_device_on_a_machine_without_one_is_a_clear_error(ckpt, args):
    out = run(*args, "--model", str(ckpt), "--port", "0")
    assert out.returncode != 0
    fix = "leave --gpus out" if "--gpus" in args else "use --device cpu"     # the flag the user gave is named
    assert "this machine has no usable CUDA GPU" in out.stderr and fix in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("change", "needle"), [
    ({"n_group": 3}, "n_group=3"),                                    # 16 experts do not split into 3 groups
    ({"topk_group": 5}, "topk_group=5"),
    ({"num_experts_per_tok": 9, "topk_group": 2}, "num_experts_per_tok=9"),   # more than 2 groups of 4 hold
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.3, "rope_type": "default"}},
     "partial_rotary_factor"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "longrope"}}, "rope type 'longrope' is not supported"),
    ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "linear", "factor": 0}}, "factor must be positive"),
    # values of the wrong type or form: tracebacks (int('many'), hidden_size 768.5 taken as 768, a limit of 0)
    ({"n_routed_experts": "many"}, "n_routed_experts must be a whole number from 1, got 'many'"),
    ({"hidden_size": 768.5}, "hidden_size must be a whole number from 1, got 768.5"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be a whole number from 1, got 0"),
    ({"rope_parameters": "yes"}, "rope_parameters must be an object (rope_type, factor, ...), got 'yes'"),
])
def test_a_routing_or_rope_config_that_cannot_work_names_the_field(oracles, tmp_path, change, needle):
    dst = tmp_path / "glm"
    shutil.copytree(oracles["glm4_moe"].path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **change}))
    out = run("validate", "--model", str(dst))
    assert out.returncode != 0 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert str(dst / "config.json") in out.stderr, out.stderr          # which checkpoint, not "config.json:" alone


@pytest.mark.parametrize(("arch", "change", "needle"), [
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method 'greedy'"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func 'softmax'"),
    ("deepseek_v2", {"scoring_func": "sigmoid"}, "scoring_func 'sigmoid'"),
])
def test_a_deepseek_config_with_an_unknown_routing_method_names_the_field(oracles, tmp_path, arch, change, needle):
    dst = tmp_path / arch
    shutil.copytree(oracles[arch].path, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **change}))
    for args in (["validate", "--model", str(dst)], ["serve", "--model", str(dst), "--port", "0"]):
        out = run(*args)
        assert out.returncode != 0 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize(("index", "needle"), [
    ("{not json", "not a readable JSON index"),
    ('{"metadata": {}}', "needs a 'weight_map' object"),
    ("[1, 2]", "needs a 'weight_map' object"),
    ('{"weight_map": {"a": 3}}', "needs a 'weight_map' object"),
    ('{"weight_map": {"a": "../x.safetensors"}}', "outside the checkpoint directory"),
])
def test_a_broken_index_is_one_line_naming_it(ckpt, index, needle):
    """It was a JSONDecodeError, KeyError or TypeError traceback from every command."""
    (ckpt / "model.safetensors.index.json").write_text(index)
    for args in (["validate", "--model", str(ckpt)], ["expert", "--model", str(ckpt), "--shard", "0/2", "--port", "0"]):
        out = run(*args)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "model.safetensors.index.json" in out.stderr and needle in out.stderr, out.stderr


def test_an_integer_weight_and_a_file_that_is_a_directory_are_refused(ckpt, tmp_path):
    """An int32 expert weight validated `ok` and was served as raw integers (other tokens, no error)."""
    odd, tok = tmp_path / "dir", tmp_path / "tok"
    shutil.copytree(ckpt, odd)
    shutil.copytree(ckpt, tok)
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    tensors = load_file(ckpt / "model.safetensors")
    tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, ckpt / "model.safetensors")
    for args in (["validate", "--model", str(ckpt)], ["expert", "--model", str(ckpt), "--shard", "0/2", "--port", "0"]):
        out = run(*args)
        assert out.returncode == 2 and f"tensor '{name}' is stored as I32" in out.stderr, out.stderr
    (odd / "model.safetensors").unlink()
    (odd / "model.safetensors").mkdir()
    out = run("validate", "--model", str(odd))
    assert out.returncode == 2 and "model.safetensors: not a regular file" in out.stderr, out.stderr
    (tok / "tokenizer.json").unlink(missing_ok=True)
    (tok / "tokenizer.json").mkdir()                     # validated `ok`; text requests then said "no tokenizer"
    out = run("validate", "--model", str(tok))
    assert out.returncode == 2 and "tokenizer.json: not a regular file" in out.stderr, out.stderr


def test_a_worker_that_does_not_match_the_router_is_one_line(ckpt):
    """The router's checks of its workers at start (--max-step-tokens, --quantize, --batch-invariant) said what to
    fix, as the last line of a traceback."""
    worker = colibri_popen(["expert", "--model", str(ckpt), "--shard", "0/1", "--port", "0", "--threads", "1",
                            "--log-level", "WARNING", "--cpu-forms", "off", "--max-step-tokens", "64"],
                           stdout=subprocess.PIPE)
    try:
        line = worker.stdout.readline()
        assert line.startswith("ready "), line
        address = line.split()[1]
        for extra, says in (([], "start the worker with --max-step-tokens 512 or more"),
                            (["--max-num-tokens", "64", "--quantize", "int8"], "the router expects int8"),
                            (["--max-num-tokens", "64", "--batch-invariant"], "--batch-invariant")):
            out = run("router", "--model", str(ckpt), "--workers", address, "--port", "0", "--cpu-forms", "off",
                      *extra)
            assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
            last = out.stderr.strip().splitlines()[-1]
            assert last.startswith("error: expert worker") and says in last, out.stderr
    finally:
        worker.terminate()
        worker.wait(timeout=30)


def test_a_worker_on_another_checkpoint_of_the_same_shapes_is_refused(ckpt, tmp_path):
    """Same config, other weights (another seed): the router took its experts and served tokens of neither
    model, with no error. The checkpoints' fingerprints differ now."""
    from tests.models import build_model, save_checkpoint, small_config

    other = save_checkpoint(build_model(small_config("qwen3_moe"), seed=99), tmp_path / "other")
    assert json.loads((other / "config.json").read_text())["hidden_size"] == \
        json.loads((ckpt / "config.json").read_text())["hidden_size"]
    worker = colibri_popen(["expert", "--model", str(other), "--shard", "0/1", "--port", "0", "--threads", "1",
                            "--log-level", "WARNING", "--cpu-forms", "off"], stdout=subprocess.PIPE)
    try:
        line = worker.stdout.readline()
        assert line.startswith("ready "), line
        out = run("router", "--model", str(ckpt), "--workers", line.split()[1], "--port", "0", "--cpu-forms", "off")
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert "serves another checkpoint than this router's --model" in out.stderr.strip().splitlines()[-1]
    finally:
        worker.terminate()
        worker.wait(timeout=30)


@pytest.mark.skipif(not native.available(), reason="the native kernels are not built here")
def test_validate_refuses_the_isa_override_the_services_refuse(ckpt):
    """validate said `ok` for COLIBRI_CPU_ISA=bogus, which router and workers refuse at start (a new process:
    the override is read when the library loads)."""
    import os
    import sys

    out = subprocess.run([sys.executable, "-m", "colibri.cli", "validate", "--model", str(ckpt)], text=True,
                         env={**os.environ, "COLIBRI_CPU_ISA": "bogus"}, capture_output=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == ("error: COLIBRI_CPU_ISA=bogus is unknown; use generic, "
                                                          "avx2, avx512, avx512bf16 or amx"), out.stderr


def test_a_cache_budget_under_one_expert_is_one_line(ckpt):
    """The worker's check of a byte budget against its expert size ended in a traceback."""
    out = run("serve", "--model", str(ckpt), "--workers", "1", "--port", "0", "--expert-cache-capacity", "100B")
    assert out.returncode != 0 and "--expert-cache-capacity 100B holds no expert: one takes" in out.stderr
    assert "Traceback" not in out.stderr, out.stderr


def test_serve_refuses_a_checkpoint_without_safetensors_before_it_starts_any_child(ckpt, tmp_path):
    """serve checked config.json first but forked its whole fleet for a checkpoint of PyTorch pickles: every child
    then said the same line. Now one line, naming the conversion, and nothing started."""
    only_bin = tmp_path / "bin"
    only_bin.mkdir()
    shutil.copy(ckpt / "config.json", only_bin)
    (only_bin / "pytorch_model.bin").write_bytes(b"\0" * 64)
    out = run("serve", "--model", str(only_bin), "--workers", "2")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.count("no *.safetensors files found") == 1 and "safe_serialization=True" in out.stderr
