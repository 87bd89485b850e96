"""A decode step's attention block as one native call (kernels.native.attention_block) gives the bits of the
op-by-op path it replaces, for every attention variant of the suite's architectures: per-head and full-width
q/k norms (Qwen3, OLMoE), qkv biases (Qwen2-MoE), sinks, sliding windows and output biases (GPT-OSS), plain
(Mixtral), in float32 and bf16, with several sequences decoding together."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kernels import cpu_forms, native
from tests.inprocess import InProcess

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.UNAVAILABLE}")


def logits(path, dtype: str, fused: bool, layers: bool = True) -> list[bytes]:
    prompts = [[random.Random(70 + i).randrange(256) for _ in range(3 + 4 * i)] for i in range(4)]
    with InProcess(path, dtype=dtype, cpu_forms="off") as engine:
        engine.engine.model.fusion.fuse_attention = fused
        engine.engine.model.fusion.fuse_layers = layers
        runs = engine.submit_all(prompts, 7, return_logits=True)     # the same batches in each run
        results = [engine.collect(r) for r in runs]
    return [b"".join(x.numpy().tobytes() for x in r.logits) + repr(r.token_ids).encode() for r in results]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss", "mixtral"])
def test_the_fused_attention_block_has_the_bits_of_the_op_by_op_path(oracles, monkeypatch, arch, dtype):
    """Three runs alike to the bit: each MoE layer of a decode step in one native call (kernels.native.decoder_layer:
    the attention block, the routing and the in-process experts), the layer up to its experts in one call
    (decoder_front, as a fleet's router runs it) or the attention block alone, and every op on its own."""
    calls = {"attention_block": 0, "decoder_layer": 0, "decoder_front": 0}

    def counting(name):
        real = getattr(native, name)

        def counted(*args):
            calls[name] += 1
            return real(*args)
        return counted

    monkeypatch.setattr(native, "attention_block", counting("attention_block"))
    monkeypatch.setattr(native, "decoder_front", counting("decoder_front"))
    real_call = native.DecoderLayerCall.__call__

    def counted_call(self, *args):          # the one-call layers, one by one or a decode plan's loop
        calls["decoder_layer"] += 1
        return real_call(self, *args)
    monkeypatch.setattr(native.DecoderLayerCall, "__call__", counted_call)
    monkeypatch.setattr(cpu_forms, "_TABLE", {})         # the defaults (native), not forms earlier tests measured
    monkeypatch.setattr(cpu_forms, "_REJECTED", set())
    whole = logits(oracles[arch].path, dtype, True)
    n_layer = calls["decoder_layer"]
    if arch not in ("qwen2_moe", "gpt_oss"):             # (shared experts, a gate's bias: call by call)
        assert n_layer > 0                               # the decode steps' MoE layers took the one-call path
    n, n_front = calls["attention_block"], calls["decoder_front"]
    assert logits(oracles[arch].path, dtype, True, layers=False) == whole
    assert calls["decoder_layer"] == n_layer
    if arch != "gpt_oss":                                # (a gate's bias: the routing call by call)
        assert calls["decoder_front"] > n_front          # the layers' fronts in one call now
    else:
        assert calls["attention_block"] > n              # the attention block alone
    n, n_front = calls["attention_block"], calls["decoder_front"]
    assert logits(oracles[arch].path, dtype, False) == whole
    assert calls["attention_block"] == n and calls["decoder_layer"] == n_layer  # and the last run took none
    assert calls["decoder_front"] == n_front


def test_a_decode_plan_runs_the_layers_and_follows_the_weights_it_was_made_from(oracles, monkeypatch):
    """Decode steps run every layer from a plan made once (router_service/model/decode_layers.py), with the bits of
    the layers called one by one; a layer's weights replaced by a copy (as RouterWeights.onto_huge_pages does while
    it serves) make a new plan, never a call on the old objects."""
    from router_service.model import fusion as fusion_module
    from router_service.model.decode_layers import DecodePlan

    counts = {"run": 0, "made": 0}
    real_run, real_make = DecodePlan.run, fusion_module.make_plan

    def run(self, *args):
        counts["run"] += 1
        return real_run(self, *args)

    def make(*args):
        counts["made"] += 1
        return real_make(*args)

    monkeypatch.setattr(DecodePlan, "run", run)
    monkeypatch.setattr(fusion_module, "make_plan", make)
    monkeypatch.setattr(cpu_forms, "_TABLE", {})
    monkeypatch.setattr(cpu_forms, "_REJECTED", set())
    prompts = [[random.Random(90 + i).randrange(256) for _ in range(2 + 3 * i)] for i in range(3)]
    with InProcess(oracles["qwen3_moe"].path, dtype="bfloat16", cpu_forms="off") as engine:
        model = engine.engine.model

        def outputs(layers: bool = True) -> list[tuple]:
            model.fusion.fuse_layers = layers
            results = [engine.collect(r) for r in engine.submit_all(prompts, 6, return_logits=True)]
            return [(r.token_ids, [x.numpy().tobytes() for x in r.logits]) for r in results]

        first = outputs()
        made, ran = counts["made"], counts["run"]
        assert ran >= 5 and made >= 1            # the 3 rows' decode steps: one plan, made once
        assert outputs() == first and counts["made"] == made and counts["run"] > ran
        caches = model.fusion.caches
        plans = dict(caches.plans)
        model.w.layers[1] = dataclasses.replace(model.w.layers[1])       # the same tensors, a new object
        engine.collect(engine.submit(prompts[0], 3))                      # one row: the 3 rows' plan stays unused,
        assert counts["made"] > made and any(rows == 3 for rows, _ in plans)   # yet holds the old layer no more
        assert all(p.weights[1] is model.w.layers[1] for p in caches.plans.values())
        assert outputs() == first
        assert all(caches.plans[key] is not plan for key, plan in plans.items() if key in caches.plans)
        model.forget_weights()                       # what the huge pages' thread calls once it has moved them
        assert not caches.plans and not caches.block_parts and not caches.routes
        made = counts["made"]
        assert outputs() == first and counts["made"] > made
        ran = counts["run"]
        assert outputs(layers=False) == first and counts["run"] == ran   # layer by layer: no plan, the same bits


def op_by_op(h, ln1, w_qkv, q_norm, k_norm, cos, sin, kc, vc, write, slots, lens, w_o, heads, kv_heads, eps):
    """The block from the native ops one at a time (the Python path's order), caches written with index_copy_."""
    T, D = h.shape[0], kc.shape[2]
    qkv = native.linear(native.rms_norm(h, ln1, eps), w_qkv)
    q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    q, k, v = q.reshape(T, heads, D), k.reshape(T, kv_heads, D), v.reshape(T, kv_heads, D)
    if q_norm is not None:
        q, k = native.rms_norm(q, q_norm, eps), native.rms_norm(k, k_norm, eps)
    q, k = native.rope(q, cos, sin), native.rope(k, cos, sin)
    kc.index_copy_(0, write, k)
    vc.index_copy_(0, write, v)
    out = native.decode_attention(q, kc, vc, slots, lens, None, D ** -0.5)
    return native.linear(out.reshape(T, heads * D), w_o)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("rotary", ["whole", "partial"])
@pytest.mark.parametrize("dtype,norms", [("float32", None), ("float32", "float32"), ("bfloat16", None),
                                         ("bfloat16", "bfloat16"), ("bfloat16", "float32")])
def test_the_fused_heads_pass_has_the_bits_of_the_ops(T, rotary, dtype, norms):
    """The block's fused pass over the heads (norm, rope, the cache writes in one loop) against the ops it replaces,
    on shapes the suite's models do not all reach: rotary dims short of the head (partial rotary), float32 per-head
    norms on bf16 activations, odd sizes."""
    import torch

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(T + 10 * len(rotary) + len(norms or ""))
    heads, kv_heads, D, H, S, eps = 6, 2, 24, 40, 64, 1e-6
    R = D if rotary == "whole" else 10

    def rand(*shape, dtype=dt):
        return torch.randn(*shape, generator=g).to(dtype)

    h, ln1 = rand(T, H), rand(H)
    w_qkv, w_o = rand((heads + 2 * kv_heads) * D, H) * 0.2, rand(H, heads * D) * 0.2
    q_norm = None if norms is None else rand(D, dtype=getattr(torch, norms))
    k_norm = None if norms is None else rand(D, dtype=getattr(torch, norms))
    cos, sin = rand(T, R), rand(T, R)
    caches = rand(S, kv_heads, D), rand(S, kv_heads, D)
    write = torch.tensor([7 + 11 * t for t in range(T)])
    lens = torch.tensor([5 + 3 * t for t in range(T)])
    C = int(lens.max())
    slots = torch.stack([torch.cat([torch.arange(40, 39 + n), write[t:t + 1], torch.zeros(C - n, dtype=torch.long)])
                         for t, n in enumerate(lens.tolist())])                 # [T, C] context, then its own
    want_k, want_v = caches[0].clone(), caches[1].clone()
    want = op_by_op(h, ln1, w_qkv, q_norm, k_norm, cos, sin, want_k, want_v, write, slots, lens, w_o, heads,
                    kv_heads, eps)
    got_k, got_v = caches[0].clone(), caches[1].clone()
    got = native.attention_block(h, ln1, w_qkv, None, q_norm, k_norm, False, cos, sin, got_k, got_v, write, slots,
                                 lens, None, w_o, None, heads, kv_heads, eps)
    assert torch.equal(got, want)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_a_write_slot_outside_the_cache_is_refused_before_anything_is_written():
    import torch

    heads, kv_heads, D, H = 2, 1, 8, 16
    kc, vc = torch.zeros(4, kv_heads, D), torch.zeros(4, kv_heads, D)
    with pytest.raises(RuntimeError, match="write slot 4 is outside the cache's 4 slots"):
        native.attention_block(torch.randn(1, H), torch.ones(H), torch.randn((heads + 2 * kv_heads) * D, H), None,
                               torch.ones(D), torch.ones(D), False, torch.randn(1, D), torch.randn(1, D), kc, vc,
                               torch.tensor([4]), torch.tensor([[0]]), torch.tensor([1]), None,
                               torch.randn(H, heads * D), None, heads, kv_heads, 1e-6)
    assert not kc.any() and not vc.any()


def test_a_cache_of_other_heads_than_the_block_is_refused_without_writing_past_it():
    """A cache with fewer heads than kv_heads: the block refuses it (as index_copy_ does), and nothing is written
    outside the cache's view, here the buffer's last slot that the view leaves out."""
    import torch

    heads, kv_heads, D, H = 2, 2, 8, 16
    buf = torch.zeros(5, 1, D)
    kc, vc = buf[:4], torch.zeros(4, 1, D)                   # [4, 1, D]: one head where the block has two
    with pytest.raises(RuntimeError):
        native.attention_block(torch.randn(1, H), torch.ones(H), torch.randn((heads + 2 * kv_heads) * D, H), None,
                               torch.ones(D), torch.ones(D), False, torch.randn(1, D), torch.randn(1, D), kc, vc,
                               torch.tensor([3]), torch.tensor([[3]]), torch.tensor([1]), None,
                               torch.randn(H, heads * D), None, heads, kv_heads, 1e-6)
    assert not buf[4].any()


def test_experts_whose_submit_is_their_own_get_no_whole_layer_call(oracles):
    """A LocalExperts subclass with a submit of its own (fault injection, counting) keeps every decode layer call
    by call, so that its submit runs; the plain class hands the layer to the one native call."""
    import torch

    from router_service.moe.experts import LocalExperts

    class Counting(LocalExperts):
        def submit(self, layer, hidden, ids, weights, prefetch=None):
            return super().submit(layer, hidden, ids, weights, prefetch)

    with InProcess(oracles["qwen3_moe"].path, dtype="bfloat16", cpu_forms="off") as engine:
        shard = engine.engine.experts.shard
        h = torch.zeros(1, engine.engine.model.cfg.hidden_size, dtype=torch.bfloat16)
        assert LocalExperts(shard).native_layer(0, h) is not None
        assert Counting(shard).native_layer(0, h) is None
