"""Colibri's native CPU kernels (kernels/native/) against float64 references on odd shapes, at every ISA level
this machine can run (`native.use_isa`), with the properties the rest of the system relies on: one float32
rounding per output, a row's result independent of the other rows and of the thread count, inputs untouched,
and clear errors for bad inputs and for an override the CPU cannot honour."""

from __future__ import annotations

import copy
import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest
import torch

from kernels import native
from kernels.activation import SILU, GatedAct
from kernels.cpu_forms import FORMS
from kernels.expert_rows import ExpertRows
from kernels.formats.int8 import X16_BLOCK, Int8Weight, quantize_int8, quantize_rows, quantize_x16
from kernels.native_build import compiler
from tests.kernels.levels import LEVELS, RUNNABLE, needs_native


def test_the_kernels_are_built_wherever_a_compiler_is():
    """make setup builds them; only a machine without g++ (or COLIBRI_NATIVE=off) runs without them."""
    if compiler() is None or os.environ.get("COLIBRI_NATIVE") == "off":
        pytest.skip("no C++ compiler here, or the native kernels are switched off")
    assert native.available(), native.UNAVAILABLE
    assert "generic" in RUNNABLE and native.isa() in RUNNABLE
    assert native.describe().startswith(f"native CPU kernels: {native.isa()}")


def test_a_workers_log_names_what_computes_its_experts():
    """The start-up line of a worker says native CPU kernels and their level only where they compute its shape."""
    from kernels import MoeShape, describe_expert_kernels
    from kernels.cpu_moe import _NATIVE_REJECTED, moe_shape_id

    bf16, int8 = MoeShape(16, 64, 96, 2, "bfloat16"), MoeShape(16, 64, 96, 2, "int8-bfloat16")
    if native.available():
        assert describe_expert_kernels("cpu", bf16) == f"native CPU kernels ({native.isa()})"
        assert describe_expert_kernels("cpu", int8) == f"native CPU kernels ({native.isa()})"
        assert describe_expert_kernels("cpu", MoeShape(16, 64, 96, 2, "float16")).startswith(
            "torch forms (the native CPU kernels take no float16")
        odd = MoeShape(16, 64, 97, 2, "bfloat16")
        _NATIVE_REJECTED.add(moe_shape_id(16, 64, 97, "bfloat16"))     # as a form check that found it wrong
        try:
            assert "found wrong for this shape" in describe_expert_kernels("cpu", odd)
        finally:
            _NATIVE_REJECTED.discard(moe_shape_id(16, 64, 97, "bfloat16"))
    else:
        assert describe_expert_kernels("cpu", bf16).startswith("torch forms (native CPU kernels: none")
    assert describe_expert_kernels("cuda", None) == "triton kernels"


def weight(dout: int, din: int, kind: str, g: torch.Generator) -> tuple[torch.Tensor | Int8Weight, torch.Tensor]:
    """A weight of `kind` and its exact float64 value."""
    w = torch.randn(dout, din, generator=g) / din**0.5                                 # [Dout, Din]
    if kind == "int8":
        q = quantize_int8(w)
        return q, q.q.double() * q.scale.double()[:, None]
    wk = w.to(getattr(torch, kind))
    return wk, wk.double()


BF16_DOT_LEVELS = ("avx512bf16", "amx")                               # bf16 x bf16 products of their own
SHAPES = [(1, 1), (37, 19), (100, 72), (33, 257), (70, 1030)]     # tails of every vector width and block
ROWS = [1, 2, 3, 4, 5, 7, 33, 67]                                   # the register path, the panel path, tails


def on_tiles(level: str, kind: str, x_dtype: torch.dtype) -> bool:
    """Whether `level` multiplies x of `x_dtype` by weights of `kind` with bf16 products (bf16 x against bf16 weights
    on AMX tiles or AVX512-BF16 dot products: float32 sums of exact products in their own order), not the float32
    path."""
    return level in BF16_DOT_LEVELS and kind == "bfloat16" and x_dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("dout,din", SHAPES)
def test_linear_against_float64(level, kind, dout, din):
    g = torch.Generator().manual_seed(dout * din)
    w, wd = weight(dout, din, kind, g)
    for x_dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(max(ROWS), din, generator=g).to(x_dtype)                      # [M, Din]
        before = (x.clone(), (w.q.clone(), w.scale.clone()) if isinstance(w, Int8Weight) else w.clone())
        for m in ROWS:
            xm = x[:m]
            want = xm.double() @ wd.T                                                  # [m, Dout]
            bound = xm.double().abs() @ wd.abs().T                                     # the terms' sizes
            q, s = (w.q, w.scale) if isinstance(w, Int8Weight) else (w, None)
            got = torch.ops.colibri.linear(xm.float(), q, s)                           # float32, unrounded
            assert got.dtype == torch.float32 and got.shape == (m, dout)
            err = float(((got.double() - want).abs() / bound.clamp(min=1e-30)).max())
            where = f"{level} {kind} x {x_dtype} [{m}, {din}] @ [{dout}, {din}].T"
            assert err <= 4e-6 * (1 + din / 1024), f"{where}: {err:.2e}"
            rounded = native.linear(xm, w)                                              # x's dtype, rounded once
            assert rounded.dtype == x_dtype
            x16 = kind == "int8" and x_dtype == torch.bfloat16 and native.int8_x16()
            if on_tiles(level, kind, x_dtype) or x16:   # their own sums: against float64, less the output's rounding
                xd = as_multiplied(xm, x16)                                            # x as multiplied
                want16, bound16 = xd @ wd.T, xd.abs() @ wd.abs().T
                err = float((((rounded.double() - want16).abs() - 2**-8 * want16.abs()) / bound16.clamp(min=1e-30))
                            .max())
                assert err <= 4e-6 * (1 + din / 1024), f"{where}, on tiles or int16 x: {err:.2e}"
            else:
                assert torch.equal(rounded, got.to(x_dtype)), where
        assert torch.equal(x, before[0]), "linear wrote to x"
        if isinstance(w, Int8Weight):
            assert torch.equal(w.q, before[1][0]) and torch.equal(w.scale, before[1][1]), "linear wrote to w"
        else:
            assert torch.equal(w, before[1]), "linear wrote to w"


def as_multiplied(x: torch.Tensor, x16: bool) -> torch.Tensor:
    """x [m, Din] as a kernel multiplies it, in float64: as it is, or with `x16` (weight-only int8 against bf16 x on a
    level with the int16 form, native.int8_x16()) quantised in blocks (formats.int8.quantize_x16)."""
    if not x16:
        return x.double()
    q, scale = quantize_x16(x)                                                          # [m, Din], [m, blocks]
    return q.double() * scale.double().repeat_interleave(X16_BLOCK, dim=1)[:, :x.shape[1]]


def test_int8_on_int16_x_stays_within_half_a_step_of_bf16_x(level):
    """Where weight-only int8 meets bf16 x quantised to int16 (every level but generic), the result is within
    float32's error of the exact product plus half a step of each block's scale times |w|; an outlier costs only its
    own block precision; rows of tiny values (blocks below 2^-64) stay right; a zero row gives zeros, a row holding
    inf or NaN NaN. Float32 x keeps the float32 form everywhere."""
    g = torch.Generator().manual_seed(11)
    w, wd = weight(70, 3 * X16_BLOCK + 37, "int8", g)
    x = torch.randn(5, wd.shape[1], generator=g).to(torch.bfloat16)                      # [5, Din]
    x[1, 5] = 1e4                                                                        # an outlier in block 0
    exact = x.double() @ wd.T                                                            # [5, Dout]
    bound = x.double().abs() @ wd.abs().T
    full = torch.ops.colibri.linear(x.float(), w.q, w.scale).double()                    # float32 x
    assert bool(((full - exact).abs() <= 4e-6 * bound).all())
    x16 = native.int8_x16()
    _, scale = quantize_x16(x)                                                           # [5, blocks]
    step = scale.double().repeat_interleave(X16_BLOCK, dim=1)[:, :x.shape[1]]           # [5, Din]
    assert float(step[1, X16_BLOCK]) < 1e-3 < float(step[1, 0])                          # the outlier's block alone
    allowed = 4e-6 * bound + ((step / 2) @ wd.abs().T if x16 else 0) + 2**-8 * exact.abs()   # + the bf16 output
    got = native.linear(x, w).double()
    assert bool(((got - exact).abs() <= allowed).all()), float(((got - exact).abs() / allowed).max())
    tiny = (torch.randn(2, x.shape[1], generator=g) * 1e-36).to(torch.bfloat16)   # blocks below 2^-64 (and 1e-34,
    want = as_multiplied(tiny, x16) @ wd.T                                          # where 32767 / amax is inf)
    exact, bound = tiny.double() @ wd.T, tiny.double().abs() @ wd.abs().T
    got = native.linear(tiny, w).double()                                           # [2, Dout]
    assert bool(((got - want).abs() <= 4e-6 * bound + 2**-8 * want.abs()).all())
    step = quantize_x16(tiny)[1].double().repeat_interleave(X16_BLOCK, dim=1)[:, :x.shape[1]]
    assert bool(((got - exact).abs() <= 4e-6 * bound + step @ wd.abs().T + 2**-8 * exact.abs()).all())
    special = torch.zeros(3, x.shape[1], dtype=torch.bfloat16)
    special[1, 300] = float("inf")
    special[2, 3] = float("nan")
    out = native.linear(special, w)                                                      # [3, Dout]
    assert bool((out[0] == 0).all())
    assert bool(out[1:].isnan().all()) if x16 else bool((~out[1:].isfinite()).all())


def test_bf16_outputs_round_as_torch_does(level):
    """A bf16 call's float32 sums are rounded to bf16 as torch's .to rounds them, special values included: ties
    to even either way, the largest finite values (to inf or not), inf and denormals; a NaN stays a NaN. A
    one-hot x picks a column of a float32 weight, so each output's float32 sum is that weight element itself."""
    tie = 1 + 2**-8                                            # halfway between two bf16 values, even below
    values = torch.tensor([tie, 1 + 3 * 2**-8, -tie, 3.4e38, 3.3895e38, -3.4e38, float("inf"), -float("inf"),
                           float("nan"), 1e-40, -1e-40, 2**-126 * (1 - 2**-9), 1.0, 65504.0, 1e-30, -7.5],
                          dtype=torch.float32)
    n = values.numel()
    w = torch.zeros(n, 3)                                      # [n, 3]: column 1 holds the values
    w[:, 1] = values
    x = torch.tensor([[0.0, 1.0, 0.0]] * 5, dtype=torch.bfloat16)                   # [5, 3]
    got = native.linear(x, w)                                                        # [5, n] bf16
    want = values.to(torch.bfloat16).expand(5, n)
    nan = values.isnan().expand(5, n)
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan]), (got[0], want[0])


def test_bf16_x_against_bf16_weights_takes_the_levels_bf16_products(level):
    """Where the level has bf16 products (AMX tiles, AVX512-BF16's VDPBF16PS), bf16 x against bf16 weights runs on
    them and nowhere else: their rule flushes a denormal input to zero, where the float32 path multiplies it (so
    this fails if the level's bf16 form is not taken, or taken where it does not exist). Rows 1-7 and a K tail."""
    w = torch.ones(40, 37, dtype=torch.bfloat16)                                      # [40, 37]
    for m in (1, 2, 5, 7):
        x = torch.zeros(m, 37, dtype=torch.bfloat16)                                  # [m, 37]
        x[:, 33] = 2.0**-130                                                           # a bf16 denormal, in the tail
        float_path = native.linear(x.float(), w)                                       # [m, 40] float32
        assert bool((float_path != 0).all())
        got = native.linear(x, w)
        assert bool((got == 0).all()) == (level in BF16_DOT_LEVELS), f"{level}, {m} rows"


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_depends_neither_on_the_other_rows_nor_on_the_threads(level, kind, x_dtype):
    """Batch invariance by construction: each row of a 67-row call equals that row alone, to the bit, at one
    thread and at two, for float32 and bf16 x (which AMX tiles take, against bf16 weights)."""
    g = torch.Generator().manual_seed(3)
    w, _ = weight(300, 1030, kind, g)
    x = torch.randn(67, 1030, generator=g).to(x_dtype)                                # [67, Din]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = native.linear(x, w)
        torch.set_num_threads(1)
        assert torch.equal(native.linear(x, w), full)
        for m in (0, 1, 4, 33, 66):
            assert torch.equal(native.linear(x[m:m + 1], w), full[m:m + 1]), f"row {m}"
        assert torch.equal(native.linear(x[3:8], w), full[3:8])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dout,din", SHAPES)
def test_int8_weights_on_tiles_against_float64(level, dout, din):
    """Weight-only int8 against bf16 x with `tiles` (native_int8_tiles: each block widened to bf16 and multiplied on
    AMX tiles; exact products, float32 sums in the tiles' order): within float32 sums of float64 less x's rounding
    at every row count and odd shape; at a level without those tiles, the float path's bits."""
    g = torch.Generator().manual_seed(dout + din)
    w, wd = weight(dout, din, "int8", g)
    x = torch.randn(max(ROWS), din, generator=g).to(torch.bfloat16)                  # [M, Din]
    for m in ROWS:
        xm = x[:m]
        got = native.linear(xm, w, tiles=True)
        assert got.dtype == torch.bfloat16 and got.shape == (m, dout)
        if native.int8_tiles():
            want = xm.double() @ wd.T                                                  # [m, Dout]
            bound = xm.double().abs() @ wd.abs().T
            err = float((((got.double() - want).abs() - 2**-8 * want.abs()) / bound.clamp(min=1e-30)).max())
            assert err <= 4e-6 * (1 + din / 1024), f"{level} [{m}, {din}] @ [{dout}, {din}].T on tiles: {err:.2e}"
        else:
            assert torch.equal(got, native.linear(xm, w)), f"{level}: tiles asked where the level has none"


def test_int8_rows_on_tiles_depend_neither_on_the_other_rows_nor_on_the_threads(level):
    """native_int8_tiles is batch-invariant as the float path is: each row of a 67-row call (three 32-row passes
    over every widened block, the last one partial) equals that row alone, at one thread and at two; and it is
    not the float path: the tiles flush a denormal input to zero (their rule), the float path multiplies it."""
    g = torch.Generator().manual_seed(5)
    w, _ = weight(300, 1030, "int8", g)
    x = torch.randn(67, 1030, generator=g).to(torch.bfloat16)                        # [67, Din]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = native.linear(x, w, tiles=True)
        torch.set_num_threads(1)
        assert torch.equal(native.linear(x, w, tiles=True), full)
        for m in (0, 1, 15, 16, 31, 32, 33, 66):
            assert torch.equal(native.linear(x[m:m + 1], w, tiles=True), full[m:m + 1]), f"row {m}"
        assert torch.equal(native.linear(x[3:40], w, tiles=True), full[3:40])
    finally:
        torch.set_num_threads(threads)
    tiny = torch.zeros(1, 1030, dtype=torch.bfloat16)
    tiny[0, 7] = 2.0**-130                                                             # a bf16 denormal
    float_path = native.linear(tiny, w)                                                # [1, 300]
    assert bool((float_path != 0).any())
    assert bool((native.linear(tiny, w, tiles=True) == 0).all()) == native.int8_tiles()


def as_w8a8(v: torch.Tensor) -> torch.Tensor:
    """A row of activations as a W8A8 kernel multiplies it: quantised (formats.int8.quantize_rows), in float64."""
    q, scale = quantize_rows(v.float()[None])
    return q[0].double() * float(scale[0])


def layer_reference(x, ids, weights, local, w13d, w2d, act, b13, b2, kind="float32") -> torch.Tensor:
    """Σ_k weights[t, k] · FFN_e(x[t]) over the pairs held here (e = local[id] >= 0), in float64, pair by pair;
    the rows entering each projection as the level in force multiplies them by weights of `kind` (W8A8: quantised
    to int8; weight-only int8 against bf16 x on the int16 form: quantised in blocks)."""
    I = w2d.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    x16 = kind == "int8" and x.dtype == torch.bfloat16 and native.int8_x16()
    q = as_w8a8 if kind == "w8a8" else (lambda v: as_multiplied(v[None], x16)[0])
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(local[ids[t, k]]) if ids[t, k] >= 0 else -1
            if e < 0:
                continue
            gu = w13d[e] @ q(x[t]) + (b13[e].double() if b13 is not None else 0)                  # [2I]
            gate, up = gu[:I], gu[I:]
            if act.limit is not None:
                gate, up = gate.clamp(max=act.limit), up.clamp(-act.limit, act.limit)
            h = gate * torch.sigmoid(act.alpha * gate) * (up + act.up_offset)                    # [I]
            out[t] += float(weights[t, k]) * (w2d[e] @ q(h) + (b2[e].double() if b2 is not None else 0))   # [H]
    return out


def expert_weights(E, I, H, kind, g):
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    if kind in ("int8", "w8a8"):
        q13, q2 = quantize_int8(w13, w8a8=kind == "w8a8"), quantize_int8(w2, w8a8=kind == "w8a8")
        return q13, q2, q13.q.double() * q13.scale.double()[..., None], q2.q.double() * q2.scale.double()[..., None]
    w13, w2 = w13.to(getattr(torch, kind)), w2.to(getattr(torch, kind))
    return w13, w2, w13.double(), w2.double()


def in_place(w13: torch.Tensor, w2: torch.Tensor, split: bool) -> tuple[ExpertRows, ExpertRows]:
    """Each expert's matrices as separate tensors, as a mapped checkpoint's per-expert gate, up and down lie (each
    its own allocation, so no two blocks are adjacent): gate and up as two blocks when `split`."""
    I = w2.shape[2]
    b13 = tuple((w[:I].clone(), w[I:].clone()) if split else (w.clone(),) for w in w13)
    return ExpertRows(b13), ExpertRows(tuple((w.clone(),) for w in w2))


def routing(T: int, K: int, E_global: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] (distinct per token, some -1) and weights [T, K] float32."""
    ids = torch.stack([torch.randperm(E_global, generator=g)[:K] for _ in range(T)]) if T else \
        torch.zeros(0, K, dtype=torch.long)
    if T:
        ids[0, -1] = -1                                                                 # a dropped pair
    return ids, torch.rand(T, K, generator=g)


GPT_OSS = GatedAct(alpha=1.702, limit=1.5, up_offset=1.0)
LAYOUTS = {"float32": ("stack", "rows", "rows split"), "bfloat16": ("stack", "rows", "rows split"), "int8": ("stack",),
           "w8a8": ("stack",)}
# W8A8: the reference quantises float64 activations where the kernel quantises float32 ones, so a value on a
# rounding boundary may land one step apart (a step is 1/127 of the row's largest value)
BOUND = {"w8a8": 2e-3}


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "w8a8"])
@pytest.mark.parametrize("E,I,H,T,K", [(1, 1, 1, 1, 1), (5, 40, 72, 7, 3), (3, 19, 33, 33, 2), (4, 24, 16, 0, 2)])
@pytest.mark.parametrize("act,biases", [(SILU, False), (GPT_OSS, True)])
def test_moe_layer_against_float64(level, kind, E, I, H, T, K, act, biases):
    """The whole expert side of a layer (sort, gather, expert FFN, routed weights, float64 sum) against float64,
    through an expert map with experts held elsewhere; packed stacks and experts in place (one or two gate/up
    blocks) to the same bits; a token's result does not depend on the other tokens of the call."""
    g = torch.Generator().manual_seed(E * I + H + T)
    w13, w2, w13d, w2d = expert_weights(E, I, H, kind, g)
    b13 = torch.randn(E, 2 * I, generator=g) if biases else None
    b2 = torch.randn(E, H, generator=g) if biases else None
    E_global = E + 3
    local = torch.full((E_global,), -1, dtype=torch.long)
    local[torch.randperm(E_global, generator=g)[:E]] = torch.arange(E)                  # [E_global] -> local
    ids, weights = routing(T, min(K, E_global), E_global, g)
    for x_dtype in (torch.float32, torch.bfloat16):
        x = (3 * torch.randn(T, H, generator=g)).to(x_dtype)                            # [T, H] past the clamps
        xr = x if kind in ("int8", "w8a8") or x_dtype == w13.dtype else x.to(w13.dtype)  # what the weights meet
        want = layer_reference(xr, ids, weights, local, w13d, w2d, act, b13, b2, kind)   # [T, H]
        results = []
        for layout in LAYOUTS[kind]:
            a13, a2 = (w13, w2) if layout == "stack" else in_place(w13, w2, layout == "rows split")
            got = native.moe_(torch.zeros(T, H, dtype=torch.float64), x, ids, weights, local, a13, a2, act, b13, b2)
            err = float((got - want).abs().max() / want.abs().max().clamp(min=1e-12)) if want.numel() else 0
            assert err <= BOUND.get(kind, 2e-5), f"{level} {kind} {layout} x {x_dtype} E={E} I={I} H={H} T={T}: " \
                f"rel err {err:.2e}"
            results.append(got)
        assert all(torch.equal(r, results[0]) for r in results)
        if T > 1:
            alone = native.moe_(torch.zeros(1, H, dtype=torch.float64), x[1:2], ids[1:2], weights[1:2], local, w13,
                                w2, act, b13, b2)
            assert torch.equal(alone, results[0][1:2])


@pytest.mark.parametrize("dout,din", SHAPES)
def test_w8a8_linear_is_torchs_int_mm_to_the_bit(level, dout, din):
    """The W8A8 kernel (int8 x int8 products, exact int32 sums: AMX's tdpbssd tiles, AVX512-VNNI's vpdpbusd on
    x + 128 less 128 * Σw, AVX2's maddubs, or a plain loop) gives the bits of the torch form it stands beside
    (`torch._int_mm` on the same quantised rows), at every row count."""
    g = torch.Generator().manual_seed(dout + din)
    w = quantize_int8(torch.randn(dout, din, generator=g), w8a8=True)
    for x_dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(max(ROWS), din, generator=g) * 4).to(x_dtype)
        for m in ROWS:
            assert torch.equal(native.linear(x[:m], w), FORMS["w8a8_intmm"].fn(x[:m], w)), f"{level} {m} rows"


def test_w8a8_rows_round_half_to_even_as_torch_does(level):
    """The activation rows' quantisation (per ISA level: AVX2 divides and rounds 8 lanes at a time, the rest one by
    one) on the ties: with a row's max |x| = 127 the scale is 1, so x / scale lands on .5 exactly; 37 columns, so
    both the vector steps and the tail see them. Read back through an identity weight, against torch's form."""
    ties = torch.tensor([2.5, -3.5, 0.5, -0.5, 1.5, -2.5, 126.5, -126.5, 4.5, 5.5, -6.5, 7.49, 0.0, -0.0])
    x = torch.zeros(3, 37)
    x[0, :14], x[0, 14] = ties, 127.0                       # ties in the first vector steps
    x[1, 23:37], x[1, 0] = ties, -127.0                     # ties across the last step and the tail
    x[2] = torch.linspace(-300, 300, 37)                    # a wider row: scale > 1, nothing clamped past +-127
    w = quantize_int8(torch.eye(37), w8a8=True)
    got, want = native.linear(x, w), FORMS["w8a8_intmm"].fn(x, w)
    assert torch.equal(got, want), f"{level}: {(got - want).abs().max()}"
    assert torch.equal(got[0, :4].round(), torch.tensor([2.0, -4.0, 0.0, -0.0]))   # half to even, through the scales


def test_moe_layer_on_views_of_a_larger_buffer(level):
    """A worker's experts are views (a slice of a packed buffer, or of a mapped file): strided over experts,
    row-major within each; acc is added to, not overwritten."""
    g = torch.Generator().manual_seed(5)
    big13, big2 = torch.randn(9, 2 * 24, 40, generator=g), torch.randn(9, 40, 24, generator=g)
    w13, w2 = big13[1::3], big2[1::3]                                                   # experts 1, 4, 7
    x = torch.randn(6, 40, generator=g)
    ids, weights = routing(6, 2, 3, g)
    start = torch.randn(6, 40, generator=g, dtype=torch.float64)
    want = start + layer_reference(x, ids, weights, torch.arange(3), w13.double(), w2.double(), SILU, None, None)
    got = native.moe_(start.clone(), x, ids, weights, None, w13, w2)
    assert float((got - want).abs().max() / want.abs().max()) <= 2e-5


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "w8a8"])
@pytest.mark.parametrize("act,biases", [(SILU, False), (GPT_OSS, True)])
def test_whole_experts_per_thread_give_the_bits_of_shared_row_blocks(level, kind, act, biases):
    """With few rows per expert each thread runs whole experts (moe_op.cpp `by_expert`: one parallel region); with
    many, the threads share each projection's row blocks. A token alone (4 and 8 experts, one row each) and the
    same token among 40 (over a dozen rows per expert) get the same bits, at one thread and at two, packed and in
    place (gate and up as two blocks), SiLU and GPT-OSS's clamped form with biases, and both match float64 (W8A8:
    with each projection's rows quantised, as the kernel does)."""
    g = torch.Generator().manual_seed(17)
    E, I, H = 12, 40, 72
    w13, w2, w13d, w2d = expert_weights(E, I, H, kind, g)
    b13 = torch.randn(E, 2 * I, generator=g) if biases else None
    b2 = torch.randn(E, H, generator=g) if biases else None
    layouts = [(w13, w2)] + ([in_place(w13, w2, True)] if kind not in ("int8", "w8a8") else [])
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for K in (4, 8):
                ids, weights = routing(40, K, E, g)
                x = (3 * torch.randn(40, H, generator=g)).to(torch.bfloat16)            # [T, H] past the clamps
                xr = x if kind in ("int8", "w8a8") or w13.dtype == x.dtype else x.to(w13.dtype)
                want = layer_reference(xr, ids, weights, torch.arange(E), w13d, w2d, act, b13, b2, kind)
                for a13, a2 in layouts:
                    many = native.moe_(torch.zeros(40, H, dtype=torch.float64), x, ids, weights, None, a13, a2, act,
                                       b13, b2)
                    assert float((many - want).abs().max() / want.abs().max()) <= BOUND.get(kind, 2e-5)
                    for t in (0, 7, 39):
                        alone = native.moe_(torch.zeros(1, H, dtype=torch.float64), x[t:t + 1], ids[t:t + 1],
                                            weights[t:t + 1], None, a13, a2, act, b13, b2)
                        assert torch.equal(alone, many[t:t + 1]), f"{level} {kind} K={K} threads={n_threads} t={t}"
    finally:
        torch.set_num_threads(threads)


def test_fused_moe_takes_experts_in_place():
    """kernels.fused_moe over ExpertRows: the packed stack's result to the bit, through an expert map."""
    from kernels import fused_moe
    if not native.available():
        pytest.skip(f"native kernels: {native.UNAVAILABLE}")
    g = torch.Generator().manual_seed(11)
    w13, w2, _, _ = expert_weights(6, 24, 40, "bfloat16", g)
    x = torch.randn(5, 40, generator=g).to(torch.bfloat16)                             # [T, H]
    ids = torch.randint(0, 9, (5, 3), generator=g)                                     # [T, K] global ids
    weights = torch.rand(5, 3, generator=g)
    emap = torch.tensor([0, -1, 1, 2, -1, 3, 4, -1, 5])                                # [E_global] -> local
    r13, r2 = in_place(w13, w2, True)
    assert torch.equal(fused_moe(x, r13, r2, ids, weights, emap), fused_moe(x, w13, w2, ids, weights, emap))
    with pytest.raises(ValueError, match="both w13 and w2"):
        fused_moe(x, r13, w2, ids, weights, emap)


def test_expert_rows_refuse_what_the_kernel_cannot_read():
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        ExpertRows(((torch.ones(4, 3, dtype=torch.float16),),))
    with pytest.raises(ValueError, match="contiguous"):
        ExpertRows(((torch.ones(3, 4).T,),))
    with pytest.raises(ValueError, match="one matrix shape per layer"):
        ExpertRows(((torch.ones(4, 3),), (torch.ones(5, 3),)))
    with pytest.raises(ValueError, match="one layout per layer"):
        ExpertRows(((torch.ones(4, 3),), (torch.ones(2, 3), torch.ones(2, 3))))


@needs_native
@pytest.mark.parametrize("T,H,P", [(1, 1, 0), (1, 72, 8), (33, 1030, 264), (5, 3, 40)])
def test_moe_sum_is_torchs_scatter_to_the_bit(T, H, P):
    """The weighted pair outputs summed into float64 at their tokens' rows: the bits of
    acc.index_add_(0, rows, (ys * w).double()), at every thread count."""
    g = torch.Generator().manual_seed(T * H + P)
    acc = torch.randn(T, H, generator=g, dtype=torch.float64)                          # [T, H]
    ys = torch.randn(P, H, generator=g) * 10 ** torch.randint(-3, 4, (P, 1), generator=g)   # [P, H] float32
    rows = torch.randint(0, T, (P,), generator=g)                                      # [P]
    w = torch.rand(P, generator=g)                                                     # [P]
    want = acc.clone().index_add_(0, rows, (ys * w[:, None]).double())
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(native.moe_sum_(acc.clone(), ys, rows, w), want)
    finally:
        torch.set_num_threads(threads)


def _moe(x, w13, w2, ids=None, local=None, s13=(), s2=()):
    ids = torch.zeros(x.shape[0], 2, dtype=torch.long) if ids is None else ids
    a, b = torch.ops.colibri.expert_blocks(w13, 1, list(s13)), torch.ops.colibri.expert_blocks(w2, 1, list(s2))
    try:
        torch.ops.colibri.moe_blocks_(torch.zeros(x.shape, dtype=torch.float64), x, ids, torch.ones(ids.shape),
                                      torch.empty(0) if local is None else local, a, b, None, None, 1.0, None, 0.0)
    finally:
        torch.ops.colibri.expert_blocks_free(a)
        torch.ops.colibri.expert_blocks_free(b)


@needs_native
@pytest.mark.parametrize("call,message", [
    (lambda: native.moe_sum_(torch.zeros(2, 4, dtype=torch.float64), torch.ones(1, 4), torch.tensor([2]),
                             torch.ones(1)), "row 2 of pair 0 is outside"),
    (lambda: native.moe_sum_(torch.zeros(2, 4), torch.ones(1, 4), torch.tensor([0]), torch.ones(1)),
     "contiguous float64"),
    (lambda: torch.ops.colibri.linear(torch.ones(2, 3), torch.ones(4, 5)), "need x [M, K] and w [Dout, K]"),
    (lambda: torch.ops.colibri.linear(torch.ones(2, 3), torch.ones(4, 3, dtype=torch.float16)),
     "float32, bfloat16 or int8"),
    (lambda: torch.ops.colibri.linear(torch.ones(2, 3), torch.ones(4, 3, dtype=torch.int8)), "per-row scales"),
    (lambda: torch.ops.colibri.linear(torch.ones(2, 3), torch.ones(4, 3, dtype=torch.int8), torch.ones(3)),
     "scale must be [Dout]"),
    (lambda: _moe(torch.ones(3, 8), [torch.ones(9, 8)], [torch.ones(8, 5)]), "gate/up has 9 rows, not 2I = 10"),
    (lambda: _moe(torch.ones(3, 8), [torch.ones(10, 8)], [torch.ones(7, 5)]), "down must be [H=8, I]"),
    (lambda: _moe(torch.ones(3, 8), [torch.ones(10, 8)], [torch.ones(8, 5, dtype=torch.bfloat16)]),
     "every weight block must be a contiguous CPU BFloat16"),
    (lambda: _moe(torch.ones(3, 8), [torch.ones(10, 8, dtype=torch.int8)], [torch.ones(8, 5, dtype=torch.int8)]),
     "int8 experts need one scale vector per expert"),
    (lambda: _moe(torch.ones(3, 8), [torch.ones(10, 8)], [torch.ones(8, 5)], ids=torch.zeros(2, 2, dtype=torch.long)),
     "need x [T, H], ids and weights [T, K]"),
    (lambda: _moe(torch.ones(3, 8), [torch.ones(10, 8)], [torch.ones(8, 5)], local=torch.tensor([3])),
     "expert map sends id 0 to row 3 of 1"),
    (lambda: torch.ops.colibri.expert_blocks([torch.ones(10, 8)] * 3, 2, []), "3 blocks in parts of 2"),
    (lambda: torch.ops.colibri.expert_blocks([torch.ones(10, 8)] * 2, 1, [torch.ones(10)]),
     "one scale vector per expert, or none"),
    (lambda: torch.ops.colibri.moe_blocks_(torch.zeros(1, 8, dtype=torch.float64), torch.ones(1, 8),
                                           torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), torch.empty(0),
                                           -5, -5, None, None, 1.0, None, 0.0), "no expert blocks numbered -5"),
])
def test_bad_inputs_are_clear_errors(call, message):
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call()


@needs_native
def test_expert_blocks_are_registered_once_and_freed_with_their_weights():
    """A layer's experts are handed to the kernel once (a number per projection, not lists of tensors each call);
    the registry lets go of them, and their memory, with the Python object that owns them."""
    g = torch.Generator().manual_seed(9)
    w13, w2, _, _ = expert_weights(3, 8, 16, "bfloat16", g)
    rows13, rows2 = in_place(w13, w2, split=True)
    x = torch.randn(2, 16, generator=g).to(torch.bfloat16)
    ids, weights = torch.tensor([[0, 2], [1, 0]]), torch.rand(2, 2, generator=g)
    want = native.moe_(torch.zeros(2, 16, dtype=torch.float64), x, ids, weights, None, w13, w2)
    got = native.moe_(torch.zeros(2, 16, dtype=torch.float64), x, ids, weights, None, rows13, rows2)
    assert torch.equal(got, want)
    first = native._blocks(rows13).id
    native.moe_(torch.zeros(2, 16, dtype=torch.float64), x, ids, weights, None, rows13, rows2)
    assert native._blocks(rows13).id == first                                       # made once
    block = weakref.ref(rows13.blocks[0][0])
    del rows13
    gc.collect()
    assert block() is None                                                          # the registry let go
    with pytest.raises(RuntimeError, match=f"no expert blocks numbered {first}"):
        torch.ops.colibri.moe_blocks_(torch.zeros(2, 16, dtype=torch.float64), x, ids, weights, torch.empty(0),
                                      first, native._blocks(rows2).id, None, None, 1.0, None, 0.0)


@needs_native
def test_a_full_cache_of_stacks_frees_nothing_a_call_uses(monkeypatch):
    """Registering w2 may evict w13's stack from the cache (or another thread may forget it) between the lookups and
    the op: the call holds both registrations, so it still computes (it once failed with "no expert blocks
    numbered"), and the cache stays within its cap."""
    monkeypatch.setattr(native, "_BLOCKS_CAP", 1)                                   # w2's registration evicts w13's
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 16, generator=g).to(torch.bfloat16)
    ids, weights = torch.tensor([[0, 1], [1, 2]]), torch.rand(2, 2, generator=g)
    for _ in range(3):
        w13, w2, _, _ = expert_weights(3, 8, 16, "bfloat16", g)
        want = native.moe_(torch.zeros(2, 16, dtype=torch.float64), x, ids, weights, None, *in_place(w13, w2, False))
        native.moe_(torch.zeros(2, 16, dtype=torch.float64), x, ids, weights, None, w13, w2)       # two new stacks
        assert len(native._BLOCKS) <= 1
        got = native.moe_(torch.zeros(2, 16, dtype=torch.float64), x, ids, weights, None, w13, w2)
        assert torch.equal(got, want)


@needs_native
def test_threads_registering_and_forgetting_stacks_never_lose_a_call(monkeypatch):
    """Four threads call the expert op on fresh stacks while another forgets them and the cache evicts: every call
    computes its own experts' result."""
    monkeypatch.setattr(native, "_BLOCKS_CAP", 3)
    g = torch.Generator().manual_seed(6)
    layers = [expert_weights(4, 8, 16, "bfloat16", g)[:2] for _ in range(6)]
    x = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    ids, weights = torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.rand(3, 2, generator=g)
    want = [native.moe_(torch.zeros(3, 16, dtype=torch.float64), x, ids, weights, None, *in_place(a, b, False))
            for a, b in layers]
    errors: list[str] = []
    stop = threading.Event()

    def call(k: int) -> None:
        for i in range(60):
            j = (i + k) % len(layers)
            try:
                got = native.moe_(torch.zeros(3, 16, dtype=torch.float64), x, ids, weights, None, *layers[j])
            except RuntimeError as exc:
                errors.append(f"thread {k} call {i}: {exc}")
                continue
            if not torch.equal(got, want[j]):
                errors.append(f"thread {k} call {i}: other bits")

    def forget() -> None:
        while not stop.is_set():
            native.forget([w for pair in layers for w in pair])

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
        f = threading.Thread(target=forget)
        for t in (*threads, f):
            t.start()
        for t in threads:
            t.join()
        stop.set()
        f.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:5]


@needs_native
def test_a_deep_copy_of_experts_registers_its_own():
    """A deep copy of in-place experts is other tensors: it registers its own (a copied number would compute the
    original's bytes, and be freed with the original)."""
    g = torch.Generator().manual_seed(8)
    w13, w2, _, _ = expert_weights(2, 8, 16, "bfloat16", g)
    rows13, rows2 = in_place(w13, w2, split=False)
    x = torch.randn(1, 16, generator=g).to(torch.bfloat16)
    ids, weights = torch.tensor([[0, 1]]), torch.ones(1, 2)
    first = native.moe_(torch.zeros(1, 16, dtype=torch.float64), x, ids, weights, None, rows13, rows2)
    copy13 = copy.deepcopy(rows13)
    assert native._blocks(copy13).id != native._blocks(rows13).id
    del rows13
    gc.collect()
    assert torch.equal(native.moe_(torch.zeros(1, 16, dtype=torch.float64), x, ids, weights, None, copy13, rows2),
                       first)


def test_gate_and_up_take_the_levels_bf16_products(level):
    """The expert op's gate/up multiply bf16 x by bf16 weights with the level's bf16 products where it has them
    (AMX tiles, VDPBF16PS), the float path elsewhere: a denormal x is flushed there and multiplied here (GPT-OSS's
    activation passes a gate's tiny value on: h = gate·σ(α·gate)·(up + 1))."""
    x = torch.zeros(1, 40, dtype=torch.bfloat16)
    x[0, 37] = 2.0**-130                                                              # a bf16 denormal, in a K tail
    w13 = torch.ones(2, 16, 40, dtype=torch.bfloat16)                                 # [E, 2I, H]
    w2 = torch.ones(2, 40, 8, dtype=torch.bfloat16)                                   # [E, H, I]
    out = native.moe_(torch.zeros(1, 40, dtype=torch.float64), x, torch.tensor([[0, 1]]), torch.ones(1, 2), None,
                      w13, w2, GPT_OSS)
    assert bool((out == 0).all()) == (level in BF16_DOT_LEVELS), level


def _child(env: dict[str, str]) -> str:
    code = "from kernels import native; print(native.describe()); print(native.refused_override())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@needs_native
def test_the_override_picks_a_level_and_refuses_what_the_cpu_lacks():
    lines = _child({"COLIBRI_CPU_ISA": "generic"}).splitlines()
    assert lines == ["native CPU kernels: generic (by COLIBRI_CPU_ISA)", "None"]
    lines = _child({"COLIBRI_CPU_ISA": "avx3000"}).splitlines()
    assert "COLIBRI_CPU_ISA=avx3000 is unknown" in lines[1] and "none" in lines[0]
    missing = [lv for lv in LEVELS if lv not in RUNNABLE]
    if missing:                                 # a level above this CPU's: refused, named, never run
        lines = _child({"COLIBRI_CPU_ISA": missing[-1]}).splitlines()
        assert f"COLIBRI_CPU_ISA={missing[-1]}: this CPU cannot run that level" in lines[1]
    with pytest.raises(RuntimeError, match="is unknown"):
        native.use_isa("avx3000")
    assert native.isa() == native.use_isa("")
    lines = _child({"COLIBRI_NATIVE": "off"}).splitlines()
    assert lines == ["native CPU kernels: none (COLIBRI_NATIVE=off); the torch forms run", "None"]
