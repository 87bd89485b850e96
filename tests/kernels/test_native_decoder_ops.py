"""The native ops of the router's decoder layers (kernels/native/attention.h, norm_op.cpp, rope_op.cpp) at every
native level this machine runs: decode attention against float64 on odd shapes (and no worse than SDPA in bf16),
invariant to the batch and the threads, never reading padding; rms_norm against float64 and torch's ops; rope to
the bit of torch's ops; clear errors for bad inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import Routing, native
from router_service.model.layers import Rope, apply_rope_torch, rms_norm_torch
from tests.kernels.levels import needs_native

# (B, Hq, Hkv, D, Dv, S): odd head dims (vector tails), Dv != D, MHA, MQA, a long context, one key
SHAPES = [(3, 6, 2, 37, 37, 200), (5, 16, 4, 64, 64, 1000), (2, 8, 8, 13, 20, 50), (1, 12, 1, 128, 128, 700),
          (4, 3, 3, 8, 8, 1)]


def attention_reference(q, k, v, slots, lens, sinks, scale) -> torch.Tensor:
    """float64 softmax attention of each row over slots[b, :lens[b]] (and the head's sink logit) -> [B, Hq, Dv]."""
    B, Hq, _ = q.shape
    R = Hq // k.shape[1]
    out = torch.empty(B, Hq, v.shape[2], dtype=torch.float64)
    for b in range(B):
        idx = slots[b, :lens[b]]
        kk, vv = k[idx].double(), v[idx].double()                      # [n, Hkv, D]
        for h in range(Hq):
            s = (kk[:, h // R] @ q[b, h].double()) * scale             # [n]
            if sinks is not None:
                s = torch.cat([s, sinks[h:h + 1].double()])
            p = torch.softmax(s, 0)[:idx.numel()]
            out[b, h] = p @ vv[:, h // R]
    return out


def case(B, Hq, Hkv, D, Dv, S, dtype, sinks, g):
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    k = torch.randn(S, Hkv, D, generator=g).to(dtype)
    v = torch.randn(S, Hkv, Dv, generator=g).to(dtype)
    C = min(S, 300)
    slots = torch.stack([torch.randperm(S, generator=g)[:C] for _ in range(B)])          # [B, C] scattered
    lens = torch.randint(1, C + 1, (B,), generator=g)
    lens[0] = C
    s = torch.randn(Hq, generator=g) if sinks else None
    return q, k, v, slots, lens, s


def sdpa(q, k, v, slots, lens, scale) -> torch.Tensor:
    """The gathered-copies path: padded keys, a mask, SDPA (what runs without the native kernels)."""
    kd, vd = k[slots], v[slots]                                                         # [B, C, Hkv, D]
    mask = (torch.arange(slots.shape[1])[None, :] < lens[:, None])[:, None, None, :]   # [B, 1, 1, C]
    return F.scaled_dot_product_attention(q[:, :, None, :], kd.transpose(1, 2), vd.transpose(1, 2), attn_mask=mask,
                                          scale=scale, enable_gqa=True)[:, :, 0, :]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_attention_against_float64(level, dtype, shape, sinks):
    g = torch.Generator().manual_seed(hash((shape, sinks)) % 2**31)
    q, k, v, slots, lens, s = case(*shape, dtype, sinks, g)
    scale = shape[3] ** -0.5
    got = native.decode_attention(q, k, v, slots, lens, s, scale)
    assert got.dtype == dtype and got.shape == (shape[0], shape[1], shape[4])
    ref = attention_reference(q, k, v, slots, lens, s, scale)
    err = (got.double() - ref).abs().max().item()
    if dtype == torch.float32:
        assert err < 2e-6, err
    else:                  # bf16 probabilities and outputs, as SDPA's flash kernel rounds them: no worse than it
        assert err < 1.6e-2, err
        if not sinks:
            sdpa_err = (sdpa(q, k, v, slots, lens, scale).double() - ref).abs().max().item()
            assert err <= sdpa_err + 2**-8, (err, sdpa_err)


def test_a_rows_attention_depends_neither_on_the_other_rows_nor_on_the_threads(level):
    g = torch.Generator().manual_seed(3)
    q, k, v, slots, lens, s = case(6, 16, 4, 64, 64, 500, torch.bfloat16, True, g)
    together = native.decode_attention(q, k, v, slots, lens, s, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        for b in range(6):
            alone = native.decode_attention(q[b:b + 1], k, v, slots[b:b + 1, :lens[b]], lens[b:b + 1], s, 0.125)
            assert torch.equal(alone, together[b:b + 1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [13, 64])
def test_decode_attention_never_reads_the_padding(level, dtype, D):
    """Slots past a row's length are padding that may point anywhere (a padded table): here far outside the
    cache, so a read of one would fault; lengths that leave every size of last key group."""
    g = torch.Generator().manual_seed(4)
    q, k, v, _, _, _ = case(5, 8, 2, D, D, 300, dtype, False, g)
    lens = torch.tensor([1, 7, 9, 17, 250])
    slots = torch.stack([torch.randperm(300, generator=g)[:256] for _ in range(5)])   # [5, 256]
    for b in range(5):
        slots[b, lens[b]:] = 1 << 50
    got = native.decode_attention(q, k, v, slots, lens, None, D ** -0.5)
    for b in range(5):
        alone = native.decode_attention(q[b:b + 1], k, v, slots[b:b + 1, :lens[b]], lens[b:b + 1], None, D ** -0.5)
        assert torch.equal(got[b:b + 1], alone)
    ref = attention_reference(q, k, v, slots, lens, None, D ** -0.5)
    assert (got.double() - ref).abs().max().item() < (2e-6 if dtype == torch.float32 else 1.6e-2)


@pytest.mark.parametrize("xd,wd", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                   (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("shape", [(1, 1024), (7, 96), (33, 1030), (5, 4, 37), (3, 1)])
def test_rms_norm_against_float64_and_torchs_ops(xd, wd, shape):
    if not native.available():
        pytest.skip(f"native kernels: {native.UNAVAILABLE}")
    g = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(*shape, generator=g)).to(xd)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(wd)
    got = native.rms_norm(x, w, 1e-6)
    assert got.dtype == xd and got.shape == x.shape
    xd64 = x.double()
    ref = w.double() * xd64 * torch.rsqrt(xd64.pow(2).mean(-1, keepdim=True) + 1e-6)
    rel = 2**-7 if xd == torch.bfloat16 else 1e-6        # bf16: one rounding, two where the weight is bf16 too
    torch.testing.assert_close(got.double(), ref, atol=1e-30, rtol=rel)
    torch_ops = rms_norm_torch(x, w, 1e-6)               # float32 sums in another order: at most a last bit apart
    if xd == torch.bfloat16:                             # a last float32 bit rarely moves a bf16 rounding
        assert (got != torch_ops).float().mean().item() <= 0.01
    torch.testing.assert_close(got, torch_ops, atol=0, rtol=2**-7 if xd == torch.bfloat16 else 4e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,heads,D,R", [(1, 16, 64, 64), (7, 5, 74, 32), (33, 4, 128, 64), (3, 2, 10, 10),
                                         (2, 3, 9, 0)])
def test_rope_is_torchs_ops_to_the_bit(dtype, T, heads, D, R):
    if not native.available():
        pytest.skip(f"native kernels: {native.UNAVAILABLE}")
    g = torch.Generator().manual_seed(6)
    cos, sin = Rope(max(R, 2), 10000.0).cos_sin(torch.arange(T) * 37, dtype) if R else \
        (torch.empty(T, 0, dtype=dtype), torch.empty(T, 0, dtype=dtype))
    base = torch.randn(T, 2 * heads * D, generator=g).to(dtype)
    x = base[:, :heads * D].reshape(T, heads, D)                    # strided rows, as a split of q, k, v gives
    got = native.rope(x, cos, sin)
    assert got.is_contiguous() and torch.equal(got, apply_rope_torch(x, cos, sin))


def _special(n: int, g: torch.Generator) -> torch.Tensor:
    """n float32 values with what a bf16 rounding must get right as c10 does: NaN, ±inf, values that round up past
    bf16's largest to inf, ties (half a bf16 step, even and odd), tiny and subnormal values, zeros."""
    bf16_max = torch.finfo(torch.bfloat16).max
    tie_even = torch.tensor([1 + 2**-8], dtype=torch.float32)          # halfway, rounds down to 1 (even)
    tie_odd = torch.tensor([1 + 3 * 2**-8], dtype=torch.float32)       # halfway, rounds up to even
    picks = torch.cat([torch.tensor([float("nan"), float("inf"), -float("inf"), bf16_max, 3.3961e38, -3.3961e38,
                                     1e-40, -1e-45, 0.0, -0.0]), tie_even, tie_odd, -tie_odd])
    x = torch.randn(n, generator=g) * 4
    x[torch.randperm(n, generator=g)[:picks.numel()]] = picks
    return x


@needs_native
def test_bf16_roundings_of_special_values_are_c10s():
    """rope, rms_norm and the linear's bf16 output round as c10's BFloat16 (torch's `.to(bfloat16)`) at NaN, ±inf,
    overflow to inf and ties: their rounding is written branch-free so that the loops vectorise (bf16.h)."""
    g = torch.Generator().manual_seed(9)
    T, heads, D = 5, 3, 64
    x = _special(T * heads * D, g).reshape(T, heads, D).to(torch.bfloat16)
    cos, sin = Rope(D, 10000.0).cos_sin(torch.arange(T) * 37, torch.bfloat16)
    exact = {"atol": 0, "rtol": 0, "equal_nan": True}    # a NaN's bits may differ (torch's vector form: 0xFFFF)
    torch.testing.assert_close(native.rope(x, cos, sin), apply_rope_torch(x, cos, sin), **exact)
    # the norm's last step, bf16(w * bf16(x * r)), where the products overflow, are NaN or tie
    xs = _special(4 * 96, g).reshape(4, 96)
    xs[0] = torch.tensor(3e38)                                           # r ~ 1/3e38: ordinary outputs
    w = _special(96, g).to(torch.bfloat16)
    for xd in (torch.bfloat16,):
        got = native.rms_norm(xs.to(xd), w, 1e-6)
        xr = xs.to(xd).float()
        r = 1 / torch.sqrt(xr.double().pow(2).mean(-1, keepdim=True).float() + 1e-6)
        want = (w.float() * (xr * r).to(torch.bfloat16).float()).to(torch.bfloat16)
        finite = torch.isfinite(xr).all(-1)                              # rows whose r is a number
        torch.testing.assert_close(got[finite], want[finite], **exact)
    # the linear's bf16 output is its float32 output rounded: products that overflow, NaN, ties
    xl = _special(3 * 40, g).reshape(3, 40)
    xl[:, :] = torch.where(torch.isfinite(xl), xl, torch.zeros(()))     # x finite: the weights carry the specials
    # ... and no subnormal x: AMX's TDPBF16PS reads one as zero (inf * it is NaN there, inf on the float path)
    xl[:, :] = torch.where(xl.abs() < torch.finfo(torch.float32).tiny, torch.zeros(()), xl)
    wl = _special(70 * 40, g).reshape(70, 40).to(torch.bfloat16)
    xb = xl.to(torch.bfloat16)
    y = native.linear(xb.float(), wl)                                   # float32 out: the same sums
    # ... but for a sum of finite products that overflow with both signs: inf + -inf = NaN where the products are
    # rounded first, +-inf where a fused multiply-add meets the second one (AMX's order), so those are left out
    prods = xb.double()[:, None, :] * wl.double()[None, :, :]          # [3, 70, 40]
    huge = prods.abs() > torch.finfo(torch.float32).max
    mixed = (huge & (prods > 0)).any(-1) & (huge & (prods < 0)).any(-1) & (huge & prods.isfinite()).any(-1)
    got = native.linear(xb, wl)
    assert (~mixed & y.isinf()).any() and (~mixed & y.isnan()).any()    # overflow and NaN still tried
    torch.testing.assert_close(got[~mixed], y[~mixed].to(torch.bfloat16), **exact)


def _attn(**kw):
    a = dict(q=torch.ones(2, 4, 8), k=torch.ones(10, 2, 8), v=torch.ones(10, 2, 8),
             slots=torch.zeros(2, 3, dtype=torch.long), lens=torch.ones(2, dtype=torch.long), sinks=None, scale=1.0)
    a.update(kw)
    return native.decode_attention(**a)


@needs_native
@pytest.mark.parametrize("call,message", [
    (lambda: _attn(slots=torch.tensor([[0, 1, 2], [3, 10, 4]]), lens=torch.tensor([1, 2])),
     "slot 10 (row 1) is outside the cache's 10 slots"),
    (lambda: _attn(lens=torch.tensor([1, 4])), "lens[1] = 4 must be in [1, 3]"),
    (lambda: _attn(lens=torch.tensor([0, 1])), "lens[0] = 0 must be in [1, 3]"),
    (lambda: _attn(k=torch.ones(10, 2, 8, dtype=torch.float16), v=torch.ones(10, 2, 8, dtype=torch.float16)),
     "the cache must be float32 or bfloat16"),
    (lambda: _attn(q=torch.ones(2, 3, 8)), "query heads (3) must be a multiple of the KV heads (2)"),
    (lambda: _attn(sinks=torch.ones(3)), "one logit per query head (4)"),
    (lambda: _attn(slots=torch.zeros(2, 3, dtype=torch.int32)), "slots must be int64"),
    (lambda: native.rms_norm(torch.ones(2, 4), torch.ones(5), 1e-6), "need x [..., H] and w [H]"),
    (lambda: native.rms_norm(torch.ones(2, 4), torch.ones(4, dtype=torch.bfloat16), 1e-6),
     "a bfloat16 weight on float32 activations"),
    (lambda: native.rms_norm(torch.ones(2, 4, dtype=torch.float16), torch.ones(4), 1e-6), "float32 or bfloat16"),
    (lambda: native.rope(torch.ones(2, 3, 4), torch.ones(2, 6), torch.ones(2, 6)), "R=6 must be even and at most"),
    (lambda: native.topk_route(torch.ones(8), Routing(2), None), "need float logits [T, E]"),
    (lambda: native.topk_route(torch.ones(2, 8), Routing(9), None), "k=9 must be in 1..8"),
    (lambda: native.topk_route(torch.ones(2, 8), Routing(2, "sigmoid"), torch.ones(7)), "bias must be float [E=8]"),
    (lambda: native.topk_route(torch.ones(2, 8), Routing(2, "softmax", False, 3, 1), None),
     "need num_groups dividing E=8"),
    (lambda: native.moe_route(torch.ones(2, 8), torch.ones(8), torch.ones(4, 8, dtype=torch.bfloat16), 1e-6,
                              Routing(2), None), "a gate [E, H] of h's dtype"),
    (lambda: native.rope(torch.ones(2, 3, 4), torch.ones(2, 4, dtype=torch.bfloat16),
                         torch.ones(2, 4, dtype=torch.bfloat16)), "must share one dtype"),
])
def test_bad_inputs_are_clear_errors(call, message):
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                       .replace(")", r"\)").replace(".", r"\.")):
        call()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_start_up_check_passes_the_ops_on_model_shapes(dtype):
    from router_service.model.native_check import check_decoder_ops

    for heads, kv_heads, head_dim, hidden, rotary in [(16, 4, 64, 1024, 64), (12, 12, 37, 96, 18), (8, 1, 128, 64, 0)]:
        assert check_decoder_ops(heads, kv_heads, head_dim, head_dim, hidden, rotary, dtype) is None
    for routing, experts in [(Routing(8, "softmax", True), 64), (Routing(8, "sigmoid", True, 8, 4, "top2", 2.5), 256),
                             (Routing(4, "topk_softmax"), 32)]:
        assert check_decoder_ops(8, 2, 32, 32, 64, 32, dtype, routing, experts) is None
    assert native.decoder_ops()


@needs_native
def test_a_wrong_routing_at_start_up_switches_the_torch_forms_on(monkeypatch):
    from kernels import route
    from router_service.model.native_check import check_decoder_ops

    real = native.topk_route
    monkeypatch.setattr(native, "topk_route", lambda logits, *a: real(-logits, *a))     # chooses the worst
    try:
        why = check_decoder_ops(8, 2, 32, 32, 64, 32, torch.float32, Routing(8, "softmax", True), 64)
        assert why == "the routing differs from torch's ops" and not native.decoder_ops()
        logits = torch.randn(3, 64)
        assert torch.equal(route(logits, Routing(8))[1], torch.topk(logits, 8).indices)      # the torch form
    finally:
        native.refuse_decoder_ops(None)


@needs_native
def test_a_wrong_op_at_start_up_switches_the_torch_forms_on(monkeypatch, caplog):
    from router_service.model import layers
    from router_service.model.native_check import check_decoder_ops

    real = native.decode_attention
    monkeypatch.setattr(native, "decode_attention", lambda *a: real(*a) * 1.01)     # a subtly wrong kernel
    try:
        why = check_decoder_ops(8, 2, 32, 32, 64, 32, torch.float32)
        assert why is not None and "decode attention is off by" in why
        assert not native.decoder_ops() and "the native decoder ops are not used" in caplog.text
        x, w = torch.randn(3, 64), torch.ones(64)
        assert torch.equal(layers.rms_norm(x, w, 1e-6), layers.rms_norm_torch(x, w, 1e-6))   # the torch forms
    finally:
        native.refuse_decoder_ops(None)
    assert native.decoder_ops()


@needs_native
def test_a_library_built_from_older_sources_is_not_used(monkeypatch):
    """A build that lacks an op these sources call (no `make setup` since a pull) leaves the torch forms, said."""
    monkeypatch.setattr(native, "OPS", (*native.OPS, "an_op_of_tomorrow"))
    why = native._load()
    assert why is not None and "lacks an_op_of_tomorrow" in why and "make setup" in why
