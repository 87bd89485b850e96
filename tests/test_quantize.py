"""--quantize int8: per-row int8 experts made at load time, against float64 references and transformers fp32."""

from __future__ import annotations

import copy

import grpc
import pytest
import torch

from colibri.client import Client
from colibri_common.checkpoint import Checkpoint
from colibri_common.config import ModelConfig
from colibri_common.fleet_token import ENV as FLEET_ENV
from colibri_common.fleet_token import new_token
from expert_service.shard import ExpertShard
from kernels import Int8Weight, cpu_has_fast_bf16, fused_moe, linear, native, quantize_int8, topk_route
from kernels.reference import fused_moe_reference
from router_service.moe.remote import RemoteExperts
from router_service.moe.transport import WorkerError
from tests.conftest import ARCHS, fleet
from tests.inprocess import InProcess
from tests.models import Oracle, build_model, memorize, save_checkpoint, small_config
from tests.test_replicas import port_of, workers_of

torch.set_num_threads(1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_quantize_int8_is_per_row_symmetric_and_close():
    w = torch.randn(40, 72, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 40)[:, None]
    q = quantize_int8(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (40,) and int(q.q.abs().max()) == 127
    err = (q.dequantize() - w).abs().amax(dim=1) / w.abs().amax(dim=1)           # per row, whatever its scale
    assert float(err.max()) <= 0.5 / 127 + 1e-6
    packed = Int8Weight.empty(3, 40, 72)
    packed[1].copy_(w)
    assert torch.equal(packed.q[1], q.q) and torch.equal(packed.scale[1], q.scale)
    assert packed.nbytes == 3 * 40 * 72 + 3 * 40 * 4


@pytest.mark.parametrize("quantize, tol", [("int8", 2e-2), ("w8a8", 4e-2)])   # measured: <= 1.5% and <= 3%
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_each_moe_layer_is_close_to_the_float64_reference(oracles, arch, dtype, quantize, tol):
    path = oracles[arch].path
    cfg = ModelConfig.from_dir(path)
    ckpt = Checkpoint(path)
    exact = ExpertShard(cfg, ckpt, 0, 1, torch.float32)
    q8 = ExpertShard(cfg, ckpt, 0, 1, dtype, quantize=quantize)
    ckpt.close()
    assert q8.weight_dtype == quantize
    assert q8.packed_bytes < 0.3 * exact.packed_bytes                     # int8 + a scale per row vs float32
    g = torch.Generator().manual_seed(1)
    for layer in cfg.moe_layers:
        x = torch.randn(33, cfg.hidden_size, generator=g)                   # [T, H]
        w, ids = topk_route(torch.randn(33, cfg.num_experts, generator=g), cfg.top_k, True)
        b13, b2 = exact.biases.get(layer, (None, None))                     # GPT-OSS: biases, clamped SwiGLU
        ref = fused_moe_reference(x, exact.w13[layer], exact.w2[layer], ids, w, act=exact.act, b13=b13, b2=b2)
        assert rel(q8.forward(layer, x.to(dtype), ids, w), ref) < tol, layer
        if quantize == "int8" and dtype == torch.float32:     # weight-only: float32 activations stay float32
            held = fused_moe_reference(x, q8.w13[layer].dequantize(torch.float64),
                                       q8.w2[layer].dequantize(torch.float64), ids, w, act=exact.act, b13=b13, b2=b2)
            assert rel(q8.forward(layer, x, ids, w), held) < 1e-5, layer
    with pytest.raises(ValueError, match="CPU path"):
        fused_moe(x, q8.w13[cfg.moe_layers[0]], q8.w2[cfg.moe_layers[0]], ids, w, backend="triton")


@pytest.fixture(scope="module")
def separated(tmp_path_factory) -> dict[str, tuple[Oracle, torch.Tensor]]:
    """Per architecture: a checkpoint trained briefly to memorise a few sequences (well-separated logits)."""
    root = tmp_path_factory.mktemp("separated")
    out = {}
    for i, arch in enumerate(ARCHS):
        if arch not in INT8_ARCHS:
            continue
        model = build_model(small_config(arch), seed=20 + i)
        data = memorize(model, steps=25, seed=i)   # top-2 gaps >= 27% of the largest logit at each step tested
        out[arch] = (Oracle(model, save_checkpoint(model, root / arch)), data)
    return out


@torch.no_grad()
def int8_experts_model(model):
    """A copy of the transformers model with its routed experts rounded to symmetric per-row int8, as Colibri
    packs them."""
    q = copy.deepcopy(model)
    for name, p in q.named_parameters():
        if ".experts." in name and p.dim() >= 2:
            scale = p.abs().amax(dim=-1, keepdim=True) / 127
            p.copy_(torch.round(p / scale) * scale)
    return q


@torch.no_grad()
def last_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0, -1].float()


# The MoE block's kinds (plain, a shared expert and a dense layer, grouped sigmoid routing, latent attention,
# expert biases and the clamp); the per-layer check above covers all nine architectures.
INT8_ARCHS = ("qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3", "gpt_oss")


@pytest.mark.parametrize("quantize, tol", [("int8", 3e-2), ("w8a8", 5e-2)])   # measured: <= 0.6%, <= 1%
@pytest.mark.parametrize("arch", INT8_ARCHS)
def test_int8_experts_give_the_greedy_tokens_of_transformers_fp32(separated, arch, quantize, tol):
    """Six prompts of a well-separated model: weight-only int8 keeps every greedy token of transformers fp32
    (measured on an AVX2 EPYC: 6/6 on each architecture, and 6/6 for W8A8 too; W8A8 must keep at least 5)."""
    oracle, data = separated[arch]
    prompts = [row[:8].tolist() for row in data[:6]]
    rounded = int8_experts_model(oracle.model)
    kept = 0
    with InProcess(oracle.path, quantize=quantize) as engine:
        for prompt in prompts:
            res = engine.generate(prompt, 12, return_logits=True)
            kept += res.token_ids == oracle.greedy(prompt, 12)
            want = oracle.last_logits(prompt)
            top2 = want.topk(2).values
            assert float(top2[0] - top2[1]) > 0.2 * float(want.abs().max())   # the choice is well separated
            # Within 3% (W8A8: 5%) of fp32, or of what transformers itself gives with the same int8 experts where
            # a routing near-tie flips an expert (a sigmoid + bias router can: MiniMax-M2 did on one prompt, 16%)
            own = rel(last_logits(rounded, prompt), want)
            assert rel(res.logits[0], want) < max(tol, 1.25 * own), own
    assert kept >= (6 if quantize == "int8" else 5), kept


def test_a_router_refuses_workers_that_compute_in_another_dtype(separated):
    """A float32 worker added to a bf16 router was taken without a word, and every stream's tokens changed."""
    oracle, _ = separated["qwen3_moe"]
    token = new_token()
    with fleet(oracle.path, 1, ["--dtype", "bfloat16"], env={FLEET_ENV: token}) as (_, proc):
        workers = tuple(port_of(w) for w in workers_of(proc))
        cfg = ModelConfig.from_dir(oracle.path)
        with pytest.raises(WorkerError, match="computes its experts in bfloat16 but this router in float32"):
            RemoteExperts(cfg, workers, torch.float32, connect_timeout_s=5, token=token, expect_dtype="float32")
        RemoteExperts(cfg, workers, torch.bfloat16, connect_timeout_s=5, token=token,
                      expect_dtype="bfloat16").close()                   # the same dtype is taken


def test_a_fleet_serves_int8_experts_and_the_router_refuses_mismatched_workers_then(separated):
    oracle, data = separated["qwen3_moe"]
    prompt = data[5, :8].tolist()
    token = new_token()
    with fleet(oracle.path, 1, ["--quantize", "int8", "--dtype", "bfloat16"], env={FLEET_ENV: token}) as (addr, proc):
        client = Client(addr)
        assert client.generate(prompt, 12).token_ids == oracle.greedy(prompt, 12)
        workers = tuple(port_of(w) for w in workers_of(proc))
        cfg = ModelConfig.from_dir(oracle.path)
        with pytest.raises(WorkerError, match="serves int8 experts but the router expects float"):
            RemoteExperts(cfg, workers, torch.bfloat16, connect_timeout_s=5, token=token)
        with pytest.raises(WorkerError, match="serves int8 experts but the router expects w8a8"):
            RemoteExperts(cfg, workers, torch.bfloat16, connect_timeout_s=5, expect_quantize="w8a8", token=token)
        with pytest.raises(WorkerError, match="without --batch-invariant and the router with it"):
            RemoteExperts(cfg, workers, torch.bfloat16, connect_timeout_s=5, expect_quantize="int8",
                          batch_invariant=True, token=token)
        with pytest.raises(grpc.RpcError) as err:                      # the fleet keeps serving meanwhile
            client.generate([], 2)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_w8a8_fleet_with_w8a8_dense_layers_serves_the_greedy_tokens(separated):
    oracle, data = separated["deepseek_v3"]                  # latent attention, grouped routing, a dense layer
    with fleet(oracle.path, 2, ["--quantize", "w8a8", "--quantize-dense", "--dtype", "bfloat16"]) as (addr, _):
        client = Client(addr)
        for row in data[:3]:
            prompt = row[:8].tolist()
            assert client.generate(prompt, 12).token_ids == oracle.greedy(prompt, 12)


def test_int8_dense_layers_take_the_activations_in_the_dtype_asked_for(separated):
    """A bf16 request on a CPU without bf16 arithmetic and without the native kernels (which take bf16 weights at
    float32 speed anywhere): the router computes its float layers in float32, and its
    int8 layers multiply bf16 activations (what was asked, and what the int8 kernel runs fastest): the same
    product as a bf16 activation times the int8 weight, returned in float32."""

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 64, generator=g), torch.randn(5, 64, generator=g)
    tagged, plain = quantize_int8(w, act_dtype=torch.bfloat16), quantize_int8(w)
    got = linear(x, tagged)
    assert got.dtype == torch.float32 and torch.equal(got, linear(x.bfloat16(), plain).float())
    oracle, _ = separated["qwen3_moe"]
    with InProcess(oracle.path, dtype="bfloat16", quantize="int8", quantize_dense=True) as engine:
        lm_head = engine.built.engine.model.w.lm_head
        routed_in_float32 = engine.built.compute_dtype == torch.float32
        assert routed_in_float32 == (not cpu_has_fast_bf16() and not native.available())   # native: bf16 kept
        assert lm_head.act_dtype == (torch.bfloat16 if routed_in_float32 else None)
