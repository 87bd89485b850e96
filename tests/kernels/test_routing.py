"""topk_route's variants (softmax, sigmoid, top-k-then-softmax; choice-only bias; group-limited choice;
renormalisation; scaling) against the float64 reference, on both backends (Triton through the interpreter) and
the torch form (the CPU backend runs the native op where it is built), against transformers' own routers for the
families that use them; the native op's choice against torch.topk's, ties and NaN included."""

from __future__ import annotations

import pytest
import torch

from kernels import Routing, native, topk_route, topk_route_torch
from kernels.reference import topk_route_reference
from router_service.model.layers import rms_norm
from tests.kernels.levels import needs_native

CASES = [
    # (T, E, k, scoring, bias, groups, topk_groups, group_score, renormalize, scaling)
    (9, 16, 4, "sigmoid", True, 4, 2, "top2", True, 2.5),          # DeepSeek-V3 / GLM-4.5
    (5, 24, 6, "sigmoid", True, 8, 3, "top2", True, 1.0),          # k not a power of two, groups of 3
    (7, 16, 3, "softmax", False, 4, 2, "max", False, 16.0),        # DeepSeek-V2 group-limited greedy
    (6, 20, 5, "sigmoid", True, 1, 1, "max", True, 1.0),           # MiniMax-M2: bias, no groups
    (8, 12, 3, "topk_softmax", False, 1, 1, "max", False, 1.0),    # GPT-OSS
    (4, 61, 5, "softmax", False, 1, 1, "max", True, 1.0),          # the old path, odd E
]


@pytest.mark.parametrize("backend", ["torch", "triton", "torch form"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[3]}-g{c[5]}-k{c[2]}" for c in CASES])
def test_every_routing_matches_the_float64_reference(backend, case):
    T, E, k, scoring, with_bias, G, TG, gs, renorm, scaling = case
    g = torch.Generator().manual_seed(E * k)
    logits = torch.randn(T, E, generator=g) * 2                                      # [T, E]
    bias = torch.randn(E, generator=g) * 0.5 if with_bias else None                  # [E]
    if backend == "torch form":
        w, ids = topk_route_torch(logits, Routing(k, scoring, renorm, G, TG, gs, scaling), bias)
    else:
        w, ids = topk_route(logits, k, renorm, scoring, bias, G, TG, gs, scaling, backend=backend)
    rw, rids = topk_route_reference(logits, k, renorm, scoring, bias, G, TG, gs, scaling)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == (T, k)
    assert torch.equal(ids, rids)
    assert torch.allclose(w.double(), rw, rtol=1e-5, atol=1e-7)
    if G > 1:        # every chosen expert lies in one of the topk_groups groups
        assert all(len({int(e) // (E // G) for e in row}) <= TG for row in ids)


def test_the_bias_steers_the_choice_but_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    for backend in ("torch", "triton"):
        w, ids = topk_route(logits, 1, False, "sigmoid", bias, backend=backend)
        assert ids.tolist() == [[3]]
        assert w.item() == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())


def test_groups_exclude_a_strong_expert_in_a_weak_group():
    # group 1 = experts 2, 3 holds the single best expert, but group 0's two together are stronger (top2 sum)
    logits = torch.tensor([[1.0, 0.9, 1.5, -5.0]])
    for backend in ("torch", "triton"):
        _, ids = topk_route(logits, 1, False, "sigmoid", None, 2, 1, "top2", backend=backend)
        assert ids.tolist() == [[0]]
        _, ids = topk_route(logits, 1, False, "sigmoid", None, 2, 1, "max", backend=backend)
        assert ids.tolist() == [[2]]


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"scoring": "relu"}, "scoring"),
    ({"num_groups": 3}, "do not split"),
    ({"num_groups": 4, "topk_groups": 5}, "topk_groups"),
    ({"num_groups": 4, "topk_groups": 1, "k": 5}, "exceeds"),
    ({"group_score": "mean"}, "group score"),
    ({"k": 0}, "top_k"),
    ({"num_groups": 8, "group_score": "top2"}, "groups of 2 or more"),     # 8 experts in 8 groups of one
    ({"scoring": "topk_softmax", "bias": torch.zeros(8)}, "correction bias"),
])
def test_routings_that_cannot_work_are_refused_naming_the_knob(kwargs, needle):
    args = {"k": 2, "renormalize": True, **kwargs}
    with pytest.raises(ValueError, match=needle):
        topk_route(torch.zeros(2, 8), **args)


def test_transformers_routers_agree(tmp_path):
    """The same logits through transformers' DeepSeek-V3, DeepSeek-V2, MiniMax-M2 and GPT-OSS routers."""
    from transformers import DeepseekV2Config, DeepseekV3Config, GptOssConfig, MiniMaxM2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    torch.manual_seed(0)
    H, E, T = 8, 16, 11
    x = torch.randn(T, H)

    def same(router_out, ours):
        (hw, hids), (w, ids) = router_out, ours
        order = hids.argsort(dim=-1)                                 # transformers returns them unsorted
        mine = ids.argsort(dim=-1)
        assert torch.equal(hids.gather(1, order), ids.gather(1, mine))
        assert torch.allclose(hw.gather(1, order).float(), w.gather(1, mine), rtol=1e-5, atol=1e-6)

    v3 = DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=H, num_attention_heads=2, num_key_value_heads=2,
                                               n_routed_experts=E, num_experts_per_tok=3, n_group=4,
                                               topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5))
    torch.nn.init.normal_(v3.weight)
    v3.e_score_correction_bias.normal_()
    logits = x @ v3.weight.T
    _, hw, hids = v3(x)
    same((hw, hids), topk_route(logits, 3, True, "sigmoid", v3.e_score_correction_bias, 4, 2, "top2", 2.5))

    v2 = DeepseekV2TopkRouter(DeepseekV2Config(hidden_size=H, num_attention_heads=2, num_key_value_heads=2,
                                               n_routed_experts=E, num_experts_per_tok=3, n_group=4,
                                               topk_group=2, topk_method="group_limited_greedy",
                                               routed_scaling_factor=16.0))
    torch.nn.init.normal_(v2.weight)
    _, hw, hids = v2(x)
    same((hw, hids), topk_route(x @ v2.weight.T, 3, False, "softmax", None, 4, 2, "max", 16.0))

    m2 = MiniMaxM2TopKRouter(MiniMaxM2Config(hidden_size=H, num_attention_heads=2, num_key_value_heads=2,
                                             num_local_experts=E, num_experts_per_tok=3))
    torch.nn.init.normal_(m2.weight)
    bias = torch.randn(E)
    _, hw, hids = m2(x, bias)
    same((hw, hids), topk_route(x @ m2.weight.T, 3, True, "sigmoid", bias))

    oss = GptOssTopKRouter(GptOssConfig(hidden_size=H, num_attention_heads=2, num_key_value_heads=2,
                                        num_local_experts=E, num_experts_per_tok=3))
    torch.nn.init.normal_(oss.weight)
    torch.nn.init.normal_(oss.bias)
    _, hw, hids = oss(x)
    same((hw, hids), topk_route(x @ oss.weight.T + oss.bias, 3, False, "topk_softmax"))


NATIVE_CASES = CASES + [
    (300, 64, 8, "softmax", False, 1, 1, "max", True, 1.0),        # Qwen3-MoE at a prefill's rows
    (33, 256, 8, "sigmoid", True, 8, 4, "top2", True, 2.5),        # DeepSeek-V3's shape
    (3, 128, 2, "softmax", False, 1, 1, "max", False, 1.0),        # k * 64 <= E: torch's partial_sort branch
    (2, 7, 7, "topk_softmax", False, 1, 1, "max", False, 1.0),     # every expert
]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", NATIVE_CASES, ids=[f"{c[3]}-E{c[1]}-g{c[5]}-k{c[2]}" for c in NATIVE_CASES])
def test_native_routing_chooses_as_torch_does(case, dtype):
    T, E, k, scoring, with_bias, G, TG, gs, renorm, scaling = case
    g = torch.Generator().manual_seed(E + k)
    logits = (torch.randn(T, E, generator=g) * 2).to(dtype)                         # [T, E]
    bias = torch.randn(E, generator=g) * 0.5 if with_bias else None                  # [E]
    routing = Routing(k, scoring, renorm, G, TG, gs, scaling)
    w, ids = native.topk_route(logits, routing, bias)
    tw, tids = topk_route_torch(logits, routing, bias)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (T, k)
    assert torch.equal(ids, tids)
    assert torch.allclose(w, tw, rtol=1e-6, atol=1e-8)                # libm's exp against torch's: a last bit
    for t in (0, T - 1):                                               # rows are independent of each other
        assert torch.equal(native.topk_route(logits[t:t + 1], routing, bias)[1], ids[t:t + 1])


@needs_native
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "topk_softmax"])
def test_native_routing_breaks_ties_and_ranks_nan_as_torch_does(scoring):
    logits = torch.zeros(4, 64)                                        # all tied
    logits[1, ::3] = 1.0                                               # 22 tied at the top
    logits[2, 5] = float("nan")                                        # NaN ranks first
    logits[3] = torch.arange(64.0) % 4                                 # four levels of 16
    routing = Routing(8, scoring, scoring != "topk_softmax")
    w, ids = native.topk_route(logits, routing, None)
    tw, tids = topk_route_torch(logits, routing, None)
    assert torch.equal(ids, tids)
    assert torch.allclose(w, tw, rtol=1e-6, atol=1e-8, equal_nan=True)
    grouped = Routing(4, "sigmoid", True, 8, 3, "top2")                # ties between groups too
    assert torch.equal(native.topk_route(logits[[0, 1, 3]], grouped, None)[1],
                       topk_route_torch(logits[[0, 1, 3]], grouped, None)[1])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 5, 37])
def test_moe_route_has_the_bits_of_its_three_ops(dtype, T):
    g = torch.Generator().manual_seed(T)
    H, E = 200, 24                                                     # odd widths: the linear's tails
    h = torch.randn(T, H, generator=g).to(dtype)                                     # [T, H]
    ln = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)                           # [H]
    gate = torch.randn(E, H, generator=g).to(dtype)                                  # [E, H]
    bias = torch.randn(E, generator=g) * 0.1                                         # [E]
    routing = Routing(6, "sigmoid", True, 4, 2, "top2", 2.5)
    r, w, ids = native.moe_route(h, ln, gate, 1e-6, routing, bias)
    r1 = rms_norm(h, ln, 1e-6)
    w1, ids1 = native.topk_route(native.linear(r1, gate), routing, bias)
    assert torch.equal(r, r1) and torch.equal(w, w1) and torch.equal(ids, ids1)
