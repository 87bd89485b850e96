"""Serving on the GPU (`--device cuda`, `serve --gpus 0`) against transformers: the in-process engine on every
architecture and real fleets (processes, gRPC on loopback, each child on the GPU) give the oracle's greedy tokens
and logits within 1e-4 in float32; in bf16 they are as close to the exact maths as transformers in bf16 on the
same GPU is."""

from __future__ import annotations

import copy

import psutil
import pytest
import torch

from colibri.client import Client
from router_service.engine.scheduler import SchedulerConfig
from tests.conftest import ARCHS, fleet
from tests.gpu.device import DEVICE, HAS_GPU
from tests.inprocess import InProcess
from tests.models import bf16_errors, build_model, save_checkpoint, small_config
from tests.test_e2e_oracle import NEW_TOKENS, PROMPTS, check_against_oracle, rel_err

PLACE = ["--gpus", "0"] if HAS_GPU else ["--device", "cpu"]


@pytest.mark.parametrize("arch", ARCHS)
def test_inprocess_engine_on_the_gpu_matches_transformers(oracles, arch):
    oracle = oracles[arch]
    with InProcess(oracle.path, device=DEVICE.type) as engine:
        assert engine.built.engine.model.device.type == DEVICE.type
        for prompt in PROMPTS:
            res = engine.generate(prompt, NEW_TOKENS, return_logits=True)
            check_against_oracle(oracle, prompt, res.token_ids, res.logits, res.finish_reason)


@pytest.mark.parametrize("arch, workers", [("qwen3_moe", 2), ("gpt_oss", 3), ("deepseek_v3", 2)])
def test_fleet_on_the_gpu_matches_transformers(oracles, arch, workers):
    """`colibri serve --gpus 0`: the router and every worker on the GPU, started as a user starts them (the
    console script, each child exec'd)."""
    oracle = oracles[arch]
    with fleet(oracle.path, workers, PLACE, exec_=True) as (addr, proc):
        children = psutil.Process(proc.pid).children()
        assert len(children) == workers + 1
        if HAS_GPU:
            assert all("--device=cuda:0" in c.cmdline() for c in children), [c.cmdline() for c in children]
        client = Client(addr)
        for prompt in PROMPTS:
            res = client.generate(prompt, NEW_TOKENS, return_logits=True)
            logits = [torch.from_numpy(x.copy()) for x in res.logits]
            check_against_oracle(oracle, prompt, res.token_ids, logits, res.finish_reason)
        client.close()


PROMPT = [3, 17, 42, 99, 5, 8, 120, 64]


@pytest.mark.skipif(not HAS_GPU, reason="torch's GPU backends")
@pytest.mark.parametrize("mask", [False, True])
def test_the_routers_attention_call_on_the_gpu_is_sdpa_and_leaves_the_backends_as_it_found_them(mask):
    """cuDNN's SDPA is excluded for the call only (its graph per sequence length); a masked grouped call repeats
    the key-value heads itself. The result is the math backend's, within bf16 rounding."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from router_service.model.sdpa import sdpa

    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 8, 1, 64, generator=g).to(DEVICE, torch.bfloat16)         # [B, Hq, 1, D]
    k = torch.randn(4, 2, 37, 64, generator=g).to(DEVICE, torch.bfloat16)        # [B, Hkv, C, D]
    v = torch.randn(4, 2, 37, 64, generator=g).to(DEVICE, torch.bfloat16)
    m = (torch.rand(4, 1, 1, 37, generator=g) > 0.2).to(DEVICE) if mask else None  # [B, 1, 1, C]
    before = torch.backends.cuda.cudnn_sdp_enabled()
    got = sdpa(q, k, v, attn_mask=m, enable_gqa=True)
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
    with sdpa_kernel([SDPBackend.MATH]):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not HAS_GPU, reason="bf16 needs the GPU (the interpreter's bf16 is wrong)")
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
@pytest.mark.parametrize("how", ["in-process", "fleet"])
def test_bfloat16_on_the_gpu_against_transformers_in_bfloat16_on_the_gpu(tmp_path, arch, how):
    """bf16 weights: no farther from the exact result (the same bf16 weights computed in float32 on the CPU) than
    transformers in bf16 on the same GPU is, by more than half again, or 2% of the largest logit where that is more
    (two bf16 engines round differently at every layer, so comparing one with the other would test luck;
    tests/test_engine.py says why); the first token is the exact model's wherever its top-2 margin is wider than
    twice that error."""
    model = build_model(small_config(arch), seed=11, dtype=torch.bfloat16)
    path = save_checkpoint(model, tmp_path / "bf16")
    with torch.no_grad():
        want = copy.deepcopy(model).float()(torch.tensor([PROMPT])).logits[0, -1]      # on the CPU
        hf = model.to(DEVICE)(torch.tensor([PROMPT], device=DEVICE)).logits[0, -1].float().cpu()
    if how == "in-process":
        with InProcess(path, dtype="bfloat16", device=DEVICE.type) as engine:
            got = engine.generate(PROMPT, 1, return_logits=True)
            token, logits = got.token_ids[0], got.logits[0]
    else:
        with fleet(path, 2, [*PLACE, "--dtype", "bfloat16"], exec_=True) as (addr, _):
            client = Client(addr)
            got = client.generate(PROMPT, 1, return_logits=True)
            token, logits = got.token_ids[0], torch.from_numpy(got.logits[0].copy())
            client.close()
    err, hf_err = bf16_errors(token, logits, want, hf)
    assert err <= max(1.5 * hf_err, 2e-2), (err, hf_err)


@pytest.mark.skipif(not HAS_GPU, reason="CUDA graphs need the GPU (tests/kernels/test_decode_graphs.py runs their "
                                        "step without one)")
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_decode_steps_replayed_from_cuda_graphs_match_transformers(oracles, arch):
    """Every bucket is captured at start; decode steps of 3, 2 and 1 sequences (bucket 4 with a padding row, 2, 1)
    replay them and give the oracle's tokens, and logits within 1e-4 at their last step."""
    oracle = oracles[arch]
    prompts, new = [*PROMPTS[:2], PROMPTS[0][:3]], [9, 7, 5]
    with InProcess(oracle.path, device=DEVICE.type, sched=SchedulerConfig(max_batch_size=8)) as llm:
        graphs = llm.engine.graphs
        assert graphs is not None and graphs.failed is None and sorted(graphs.graphs) == graphs.buckets == [1, 2, 4, 8]
        handles = [llm.submit(p, n, return_logits=True) for p, n in zip(prompts, new, strict=True)]
        results = [InProcess.collect(h) for h in handles]
        assert graphs.replays >= max(new) - 1 and graphs.replays == graphs.runs
        assert llm.metrics()["colibri:cuda_graph_replays_total"] == graphs.replays
    for p, n, res in zip(prompts, new, results, strict=True):
        assert res.token_ids == oracle.greedy(p, n), f"prompt {p}"
        assert rel_err(res.logits[-1], oracle.last_logits(p + res.token_ids[:-1])) < 1e-4


@pytest.mark.skipif(not HAS_GPU, reason="CUDA graphs need the GPU")
@pytest.mark.parametrize("arch, eager, why", [("qwen3_moe", True, None), ("deepseek_v3", False, "latent attention")])
def test_enforce_eager_and_latent_attention_run_op_by_op(oracles, arch, eager, why, caplog):
    oracle = oracles[arch]
    with caplog.at_level("INFO", logger="colibri.router"), \
            InProcess(oracle.path, device=DEVICE.type, enforce_eager=eager) as llm:
        assert llm.engine.graphs is None
        res = llm.generate(PROMPTS[0], NEW_TOKENS, return_logits=True)
        check_against_oracle(oracle, PROMPTS[0], res.token_ids, res.logits, res.finish_reason)
    assert f"CUDA graphs: off ({'--enforce-eager' if eager else why}" in caplog.text
