"""Colibri against transformers: greedy tokens identical, logits within 1e-4 relative (float32).

Every architecture through the in-process engine (the maths: attention, norms, gates, shared experts,
dense layers); real fleets (`colibri serve`, processes, gRPC on loopback) with 1, 2 and 3 workers on
Qwen3-MoE over streams, on Qwen2-MoE (shared expert, dense layer, biases) with 3 over unary calls, and on
GLM-4.5 (sigmoid routing with a correction bias in 2 of 4 groups, routed scaling, an ungated shared expert, a
dense first layer, partial rotary, qk-norm), DeepSeek-V3 (latent attention) and GPT-OSS (expert biases, the
clamped SwiGLU) with 3, for the sharding, both transports and the wire.
"""

from __future__ import annotations

import grpc
import psutil
import pytest
import torch

from colibri.client import Client
from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from router_service.engine.scheduler import SchedulerConfig
from router_service.model.weights import RouterWeights
from tests.conftest import ARCHS, fleet
from tests.inprocess import InProcess
from tests.models import Oracle, build_model, save_checkpoint, small_config

PROMPTS = [[3, 17, 42, 99, 5, 8], [200], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 1, 2]]
NEW_TOKENS = 16


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def check_against_oracle(oracle, prompt: list[int], token_ids: list[int], logits: list[torch.Tensor],
                         finish_reason: str) -> None:
    assert finish_reason == "length"
    assert token_ids == oracle.greedy(prompt, NEW_TOKENS), f"prompt {prompt}"
    assert len(logits) == NEW_TOKENS
    assert rel_err(logits[0], oracle.last_logits(prompt)) < 1e-4
    # the logits of a later step too: the KV cache path, not only prefill
    assert rel_err(logits[5], oracle.last_logits(prompt + token_ids[:5])) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_inprocess_engine_matches_transformers(oracles, arch):
    oracle = oracles[arch]
    with InProcess(oracle.path) as engine:
        for prompt in PROMPTS:
            res = engine.generate(prompt, NEW_TOKENS, return_logits=True)
            check_against_oracle(oracle, prompt, res.token_ids, res.logits, res.finish_reason)


# Fleets for what processes add (sharding, both transports, the wire), on each kind of MoE block: plain routed
# experts 1-3 ways; a shared expert, a dense layer and biases (Qwen2-MoE); grouped sigmoid routing with a
# shared expert (GLM-4.5); latent attention (DeepSeek-V3); expert biases and the clamped SwiGLU on the workers
# (GPT-OSS). Every architecture's maths is checked in-process above.
@pytest.mark.parametrize("arch, workers, transport", [
    ("qwen3_moe", 1, "stream"), ("qwen3_moe", 2, "stream"), ("qwen3_moe", 3, "stream"), ("qwen2_moe", 3, "unary"),
    ("glm4_moe", 3, "stream"), ("deepseek_v3", 3, "stream"), ("gpt_oss", 3, "stream")])
def test_fleet_matches_transformers(oracles, arch, workers, transport):
    oracle = oracles[arch]
    with fleet(oracle.path, workers, ["--transport", transport]) as (addr, _):
        client = Client(addr)
        for prompt in PROMPTS:
            res = client.generate(prompt, NEW_TOKENS, return_logits=True)
            logits = [torch.from_numpy(x.copy()) for x in res.logits]
            check_against_oracle(oracle, prompt, res.token_ids, logits, res.finish_reason)
        if arch == "qwen2_moe":      # these oracle checkpoints have no tokenizer.json: text is refused clearly
            with pytest.raises(grpc.RpcError) as err:
                client.generate("some text", 4)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "no tokenizer.json" in err.value.details()
        client.close()


def test_fleet_on_the_triton_kernels_matches_transformers(oracles, capfd):
    """The serving path with the Triton kernels (router top-k, workers' fused MoE), run by the interpreter on
    CPU tensors: the same code a GPU worker runs, checked against transformers without a GPU. This fleet starts
    as a GPU fleet does: the console script exec'd (the others are forked by the suite's fork server), and each
    child exec'd by it (--spawn exec, the default with GPUs) with the environment it was given."""
    oracle = oracles["qwen3_moe"]
    env = {"COLIBRI_MOE_BACKEND": "triton", "TRITON_INTERPRET": "1"}
    with fleet(oracle.path, 2, ["--log-level", "INFO", "--spawn", "exec"], env=env, exec_=True) as (addr, proc):
        children = psutil.Process(proc.pid).children()
        assert len(children) == 3
        for child in children:                                        # router and both workers run Triton
            assert env.items() <= child.environ().items()
        client = Client(addr)
        prompt = PROMPTS[0]
        res = client.generate(prompt, 6, return_logits=True)
        assert res.token_ids == oracle.greedy(prompt, 6)
        assert rel_err(torch.from_numpy(res.logits[0].copy()), oracle.last_logits(prompt)) < 1e-4
        client.close()
    log = capfd.readouterr().err                                     # router and both workers ran Triton
    assert log.count("triton (interpreter) kernels") == 2 and log.count("triton (interpreter) routing") == 1, log
    assert log.count("started pid") == 3 and "forked pid" not in log


@pytest.mark.parametrize("arch", ["glm4_moe", "deepseek_v3"])
def test_sigmoid_routers_stay_float32_when_serving_bfloat16(oracles, arch):
    """transformers keeps GLM-4.5's and DeepSeek's gates and correction biases in float32 (near-ties decide
    experts); the router's weights in bfloat16 keep them so (loaded directly: a CPU without native bf16
    computes in float32 anyway), and a bf16 engine serves."""
    path = oracles[arch].path
    ckpt = Checkpoint(path)
    weights = RouterWeights.load(ckpt, ModelConfig.from_dir(path), torch.bfloat16)
    ckpt.close()
    moe = [lw for lw in weights.layers if lw.gate is not None]
    assert moe and all(lw.gate.dtype == lw.gate_correction.dtype == torch.float32 for lw in moe)
    assert all((lw.qkv if lw.mla is None else lw.mla.w_uk).dtype == torch.bfloat16 for lw in weights.layers)
    with InProcess(path, dtype="bfloat16") as engine:
        assert len(engine.generate(PROMPTS[0], 4).token_ids) == 4


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_latent_attention_with_chunked_prefill_and_int8_dense_layers(oracles, arch):
    """Chunked prefill (a prompt over several steps, masked prefill over cached latents) gives the same tokens;
    --quantize-dense int8s the latent projections too and still serves."""
    oracle = oracles[arch]
    prompt = [(11 * j + 5) % 256 for j in range(30)]
    with InProcess(oracle.path, sched=SchedulerConfig(max_num_tokens=8)) as engine:
        res = engine.generate(prompt, NEW_TOKENS, return_logits=True)
        check_against_oracle(oracle, prompt, res.token_ids, res.logits, res.finish_reason)
    with InProcess(oracle.path, quantize_dense=True) as engine:
        assert type(engine.built.engine.model.w.layers[0].mla.kv_a).__name__ == "Int8Weight"
        assert len(engine.generate(prompt, 4).token_ids) == 4


def test_latent_attention_caches_the_compressed_latent_at_its_real_size(oracles):
    """DeepSeek's KV cache holds kv_lora_rank + qk_rope_head_dim values per token and layer (32 + 8 here),
    not the 4 heads x (24 + 24) keys and values it expands to: the budget counts that."""
    path = oracles["deepseek_v3"].path
    with InProcess(path, kv_cache_mb=1, block_size=16, sched=SchedulerConfig(max_model_len=256)) as engine:
        assert engine.metrics()["colibri:kv_cache_blocks_total"] == 2**20 // (3 * 16 * (32 + 8) * 4)
        assert engine.generate(PROMPTS[0], 4).token_ids == oracles["deepseek_v3"].greedy(PROMPTS[0], 4)


ROPES = [
    ("qwen3_moe", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}),
    ("qwen3_moe", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "rope_theta": 1e4,
                   "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16, "beta_slow": 2}),      # DeepSeek-style
    ("glm4_moe", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4,
                  "partial_rotary_factor": 0.5}),                                                   # partial + YaRN
    ("mixtral", {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}),
    ("olmoe", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    ("deepseek_v3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4,
                     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),   # MLA's softmax scale
]


@pytest.mark.parametrize(("arch", "rope"), ROPES, ids=[f"{a}-{r['rope_type']}" for a, r in ROPES])
def test_rope_scaling_matches_transformers(tmp_path, arch, rope):
    model = build_model(small_config(arch, rope_parameters=rope), seed=11)
    oracle = Oracle(model, save_checkpoint(model, tmp_path / arch))
    with InProcess(oracle.path) as engine:
        prompt = [(5 * j + 3) % 256 for j in range(40)]                 # positions far enough to matter
        res = engine.generate(prompt, NEW_TOKENS, return_logits=True)
        check_against_oracle(oracle, prompt, res.token_ids, res.logits, res.finish_reason)
