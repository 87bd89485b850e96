"""The Triton kernels compiled for and run on the GPU, against float64 references: every activation dtype (bf16
too, which the interpreter cannot run), every routing pattern, token counts past several blocks, GPT-OSS's
clamped activation with biases, FP8 and MXFP4 experts, the float64 accumulator the workers add into, and every
routing the router's top-k kernel takes."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_moe, topk_route
from kernels.reference import fused_moe_reference, topk_route_reference
from tests.gpu.device import DEVICE, DTYPES, on
from tests.kernels.test_fused_moe import (
    GPT_OSS,
    TOL,
    case_and_reference,
    fingerprint,
    make_case,
    mxfp4_values,
    to_fp8,
    to_mxfp4,
)
from tests.kernels.test_routing import CASES

# Odd expert counts and top-k, 1 token to 1024 (many blocks of every expert), on every dtype.
GRID = [(T, E, K) for T in (1, 3, 64, 257, 1024) for E, K in ((8, 2), (60, 8), (21, 3))]


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.cpu().double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E,K", GRID)
def test_fused_moe_matches_float64(T, E, K, dtype):
    for pattern in ("random", "expert_map", "one_expert"):
        case, ref, inputs = case_and_reference(T, E, K, dtype, pattern)
        x, w13, w2, ids, w, emap = (on(t) for t in case)
        out = torch.full_like(x, float("nan"))                          # poisoned: an unwritten row fails
        got = fused_moe(x, w13, w2, ids, w, emap, backend="triton", out=out)
        assert got.data_ptr() == out.data_ptr() and got.dtype == dtype and got.device.type == DEVICE.type
        assert torch.isfinite(got).all(), f"{pattern}: a row was not written"
        assert rel_err(got, ref) <= TOL[dtype], f"T={T} E={E} K={K} {dtype} {pattern}: {rel_err(got, ref):.2e}"
        assert fingerprint(t.cpu() for t in (x, w13, w2, ids, w, emap) if t is not None) == inputs


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_float64_accumulator_the_workers_add_into(dtype):
    """A worker's partial sum: float32 pair outputs added into a float64 [T, H] on the device."""
    (x, w13, w2, ids, w, emap), ref, _ = case_and_reference(257, 21, 3, dtype, "expert_map")
    start = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = fused_moe(*(on(t) for t in (x, w13, w2, ids, w, emap)), backend="triton", acc=on(start.clone()))
    assert got.dtype == torch.float64
    # the pairs' outputs are float32 before they are summed: dtype's rounding of x and w only
    assert rel_err(got - on(start), ref) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E,K,pattern", [(1, 8, 2, "random"), (17, 21, 3, "expert_map"), (300, 8, 4, "one_expert")])
def test_clamped_swiglu_with_expert_biases(T, E, K, pattern, dtype):
    x, w13, w2, ids, w, emap = make_case(T, E, K, torch.float32, pattern, seed=T)
    x = 3 * x                                                            # pre-activations past the limit
    g = torch.Generator().manual_seed(E)
    b13, b2 = torch.randn(E, 80, generator=g), torch.randn(E, x.shape[1], generator=g)
    x, w13, w2, b13, b2 = (t.to(dtype) for t in (x, w13, w2, b13, b2))
    ref = fused_moe_reference(x, w13, w2, ids, w, emap, act=GPT_OSS, b13=b13, b2=b2)
    got = fused_moe(*(on(t) for t in (x, w13, w2, ids, w, emap)), backend="triton", act=GPT_OSS, b13=on(b13),
                    b2=on(b2))
    assert got.dtype == dtype and rel_err(got, ref) <= TOL[dtype], f"{dtype} {pattern}: {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
@pytest.mark.parametrize("T,E,K,pattern", [(1, 8, 2, "random"), (17, 21, 3, "expert_map"), (300, 8, 4, "one_expert")])
def test_fp8_experts(T, E, K, pattern, block, dtype):
    """Block-scaled e4m3 experts as DeepSeek-V3 publishes them, decoded in the kernel's tiles (native FP8 on
    sm_89+), against the reference on their dequantised values."""
    x, w13, w2, ids, w, emap = make_case(T, E, K, torch.float32, pattern, seed=T)
    q13, q2 = to_fp8(w13, block), to_fp8(w2, block)
    ref = fused_moe_reference(x.to(dtype), q13.dequantize(), q2.dequantize(), ids, w, emap)
    dq13 = type(q13)(on(q13.values), on(q13.scales), q13.block)
    dq2 = type(q2)(on(q2.values), on(q2.scales), q2.block)
    got = fused_moe(on(x.to(dtype)), dq13, dq2, on(ids), on(w), on(emap), backend="triton")
    assert got.dtype == dtype and rel_err(got, ref) <= TOL[dtype], f"{dtype} {block} {pattern}: {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("T,E,K,pattern", [(1, 8, 2, "random"), (17, 21, 3, "expert_map"), (300, 8, 4, "one_expert")])
def test_mxfp4_experts(T, E, K, pattern, dtype):
    """MXFP4 experts as GPT-OSS publishes them, with its biases, decoded in the kernel's tiles."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 96, generator=g).to(dtype)
    w13, w2 = torch.randn(E, 128, 96, generator=g) / 10, torch.randn(E, 96, 64, generator=g) / 8
    _, _, _, ids, w, emap = make_case(T, E, K, torch.float32, pattern, seed=T)
    b13, b2 = torch.randn(E, 128, generator=g).to(dtype), torch.randn(E, 96, generator=g).to(dtype)
    q13, q2 = to_mxfp4(w13), to_mxfp4(w2)
    ref = fused_moe_reference(x, mxfp4_values(q13), mxfp4_values(q2), ids, w, emap, act=GPT_OSS, b13=b13, b2=b2)
    dq13, dq2 = (type(q)(on(q.blocks), on(q.scales)) for q in (q13, q2))
    got = fused_moe(on(x), dq13, dq2, on(ids), on(w), on(emap), backend="triton", act=GPT_OSS, b13=on(b13),
                    b2=on(b2))
    tol = TOL[dtype] + (1e-3 if dtype == torch.float16 else 0)
    assert got.dtype == dtype and rel_err(got, ref) <= tol, f"{dtype} {pattern}: {rel_err(got, ref):.2e}"


@pytest.mark.parametrize("case", [*CASES, (257, 128, 8, "softmax", False, 1, 1, "max", True, 1.0),
                                  (300, 256, 8, "sigmoid", True, 8, 4, "top2", True, 2.5)],
                         ids=lambda c: f"T{c[0]}-E{c[1]}-{c[3]}-g{c[5]}-k{c[2]}")
def test_every_routing_matches_the_float64_reference(case):
    """The router's top-k kernel, including Qwen3-30B's 128 experts and DeepSeek-V3's 256 in 8 groups."""
    T, E, k, scoring, with_bias, G, TG, gs, renorm, scaling = case
    g = torch.Generator().manual_seed(E * k)
    logits = torch.randn(T, E, generator=g) * 2                                      # [T, E]
    bias = torch.randn(E, generator=g) * 0.5 if with_bias else None                  # [E]
    w, ids = topk_route(on(logits), k, renorm, scoring, on(bias), G, TG, gs, scaling, backend="triton")
    rw, rids = topk_route_reference(logits, k, renorm, scoring, bias, G, TG, gs, scaling)
    assert w.device.type == ids.device.type == DEVICE.type
    assert torch.equal(ids.cpu(), rids)
    assert torch.allclose(w.cpu().double(), rw, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the GPU branch of rms_norm")
@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                              (torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_rms_norm_on_the_gpu_is_transformers_rmsnorm(x_dtype, w_dtype):
    """torch's fused norm on the GPU against the same maths in plain ops on the CPU (one rounding of the dtype)."""
    from router_service.model.layers import rms_norm, rms_norm_torch

    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(37, 1000, generator=g)).to(x_dtype)                     # [T, H]
    w = (1 + 0.1 * torch.randn(1000, generator=g)).to(w_dtype)                   # [H]
    got = rms_norm(on(x), on(w), 1e-6)
    want = rms_norm_torch(x, w, 1e-6)
    assert got.dtype == want.dtype
    ulp = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}[x_dtype]
    assert float(((got.cpu().float() - want.float()).abs() / want.float().abs().clamp(min=1e-3)).max()) <= ulp
