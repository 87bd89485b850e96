"""fused_moe and topk_route against float64 references, over a grid of shapes, on both backends."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from kernels import (
    Fp8Weight,
    GatedAct,
    Mxfp4Weight,
    cpu_forms,
    cpu_moe,
    fused_moe,
    mxfp4,
    native,
    quantize_int8,
    topk_route,
)
from kernels.cpu_forms import bucket
from kernels.reference import fused_moe_reference, topk_route_reference

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}
H, I = 72, 40            # not multiples of any block size


def make_case(T: int, E: int, K: int, dtype: torch.dtype, pattern: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I**0.5).to(dtype)
    expert_map = None
    if pattern == "one_expert":   # every token routed to the same experts
        ids = torch.arange(K).repeat(T, 1)
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    if pattern == "expert_map":   # a worker holding every other expert of a 2E-expert model
        expert_map = torch.full((2 * E,), -1, dtype=torch.long)
        expert_map[::2] = torch.arange(E)
        ids = torch.stack([torch.randperm(2 * E, generator=g)[:K] for _ in range(T)])
        ids[0, 0] = -1          # a dropped pair
    w = torch.rand(T, K, generator=g)
    return x, w13, w2, ids, w, expert_map


def fingerprint(tensors) -> tuple[float, ...]:
    return tuple(float(t.double().abs().sum()) for t in tensors if t is not None)


@functools.lru_cache(maxsize=16)
def case_and_reference(T: int, E: int, K: int, dtype: torch.dtype, pattern: str):
    """A case, its float64 reference (a Python loop over the pairs) and its inputs' fingerprint, made once for
    the forms and backends checked on it one after another."""
    case = make_case(T, E, K, dtype, pattern)
    return case, fused_moe_reference(*case), fingerprint(case)          # [T, H] float64


def check(backend: str, T: int, E: int, K: int, dtype: torch.dtype, pattern: str) -> None:
    (x, w13, w2, ids, w, emap), ref, inputs = case_and_reference(T, E, K, dtype, pattern)
    out = torch.full_like(x, float("nan"))                               # poisoned: unwritten rows fail
    got = fused_moe(x, w13, w2, ids, w, emap, backend=backend, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    assert torch.isfinite(got).all(), "a row was not written"
    err = float((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
    assert err <= TOL[dtype], f"{backend} T={T} E={E} K={K} {dtype} {pattern}: rel err {err:.2e}"
    assert fingerprint((x, w13, w2, ids, w, emap)) == inputs, f"{backend} wrote to its inputs"


GRID = list(itertools.product([1, 3, 64, 257], [8, 60], [1, 2, 8]))
# The interpreter's cost grows with the blocks it runs: 129 tokens are still odd and span many blocks (nine
# per expert at 8 experts and top-8). Every token count meets every top-k and both expert counts, and each
# expert count every top-k (half the product).
TRITON_GRID = [(T, 8 if (i + j) % 2 else 60, K) for i, T in enumerate([1, 3, 64, 129]) for j, K in enumerate([1, 2, 8])]


@pytest.fixture
def moe_forms():
    saved, rejected = dict(cpu_moe._TABLE), set(cpu_moe._NATIVE_REJECTED)
    yield cpu_moe.install_moe
    cpu_moe._TABLE.clear()
    cpu_moe._TABLE.update(saved)
    cpu_moe._NATIVE_REJECTED.clear()
    cpu_moe._NATIVE_REJECTED.update(rejected)


CPU_FORMS = [*cpu_moe.MOE_FORMS, *(["native"] if native.available() else [])]


@pytest.mark.parametrize("form", CPU_FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,E,K", GRID)
def test_cpu_path(T, E, K, dtype, form):
    """Each CPU form, run as asked, over every pattern; and the public path, which picks one."""
    for pattern in ("random", "expert_map", "one_expert"):
        (x, w13, w2, ids, w, emap), ref, inputs = case_and_reference(T, E, K, dtype, pattern)
        got = cpu_moe.fused_moe_cpu(x, w13, w2, ids, w, emap, form=form)
        assert got.dtype == dtype and torch.isfinite(got).all()
        err = float((got.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-12))
        assert err <= TOL[dtype], f"{form} T={T} E={E} K={K} {dtype} {pattern}: rel err {err:.2e}"
        assert fingerprint((x, w13, w2, ids, w, emap)) == inputs, f"{form} wrote to its inputs"
        if form == CPU_FORMS[-1]:
            check("torch", T, E, K, dtype, pattern)


def test_the_native_expert_ffn_serves_where_it_can_and_the_table_elsewhere(moe_forms):
    x, w13 = torch.empty(3, H), torch.empty(8, 2 * I, H)
    moe_forms({cpu_moe.moe_key(8, I, H, "float32", bucket(3)): "grouped"})
    assert cpu_moe.pick_moe(x, w13) == ("native" if native.available() else "grouped")
    moe_forms({}, {cpu_moe.moe_shape_id(8, I, H, "float32")})                 # found wrong on this machine
    assert cpu_moe.pick_moe(x, w13) == "grouped"
    assert cpu_moe.pick_moe(x.half(), w13.half()) == "loop"                  # a kind the native one does not take


def split(E: int, workers: int, strided: bool) -> list[list[int]]:
    """The experts each of `workers` holds: contiguous shards, or every workers-th expert."""
    return [list(range(w, E, workers)) if strided else list(range(w * E // workers, (w + 1) * E // workers))
            for w in range(workers)]


def partial_sums(x, w13, w2, ids, w, held: list[int], rounds: int = 1) -> torch.Tensor:
    """What a worker holding `held` returns: its float64 sum, over `rounds` calls as a bounded cache makes."""
    emap = torch.full((w13.shape[0],), -1, dtype=torch.long)
    emap[held] = torch.arange(len(held))
    acc = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(rounds):
        part = torch.full_like(emap, -1)
        part[held[r::rounds]] = emap[held[r::rounds]]
        fused_moe(x, w13[held], w2[held], ids, w, part, backend="torch", acc=acc)
    return acc


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_moe_sum_is_the_same_bits_however_the_experts_are_spread(dtype):
    """Float32 pair outputs summed in float64 are exact: 1, 2 or 3 workers, contiguous or strided shards, cache
    rounds, all give the one call's result to the bit once rounded. Rounding each worker's sum to the compute
    dtype (as before) does not."""
    x, w13, w2, ids, w, _ = make_case(33, 24, 4, dtype, "random", seed=9)
    whole = fused_moe(x, w13, w2, ids, w, backend="torch")
    rounded_each = torch.zeros_like(x, dtype=torch.float32)
    for workers, strided, rounds in [(1, False, 3), (2, False, 1), (3, False, 2), (3, True, 1), (2, True, 4)]:
        acc = sum(partial_sums(x, w13, w2, ids, w, held, rounds) for held in split(24, workers, strided))
        assert torch.equal(acc.to(dtype), whole), (workers, strided, rounds)
        if workers == 3:
            rounded_each = sum(partial_sums(x, w13, w2, ids, w, held).to(dtype).float()
                               for held in split(24, workers, strided))
    assert not torch.equal(rounded_each.to(dtype), whole)


def test_acc_must_be_float64_of_the_shape_and_the_triton_path_adds_into_it():
    x, w13, w2, ids, w, _ = make_case(5, 8, 2, torch.float32, "random")
    with pytest.raises(ValueError, match="acc must be a contiguous float64 tensor of shape"):
        fused_moe(x, w13, w2, ids, w, acc=torch.zeros(5, H))
    start = torch.randn(5, H, dtype=torch.float64)
    got = fused_moe(x, w13, w2, ids, w, backend="triton", acc=start.clone())
    want = start + fused_moe_reference(x, w13, w2, ids, w)
    assert float((got - want).abs().max() / want.abs().max()) <= TOL[torch.float32]


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8", "w8a8"])
def test_batch_invariance_gives_each_token_the_same_bits_in_any_call(kind):
    """Every pair alone: a token's result in a call of 64 tokens is the one it gets alone, or among 5."""
    dtype = torch.float32 if kind in ("float32", "w8a8") else torch.bfloat16
    x, w13, w2, ids, w, emap = make_case(64, 8, 3, dtype, "expert_map", seed=2)
    if kind in ("int8", "w8a8"):
        w13, w2 = quantize_int8(w13.float(), w8a8=kind == "w8a8"), quantize_int8(w2.float(), w8a8=kind == "w8a8")
    cpu_forms.set_batch_invariant(True)
    try:
        whole = fused_moe(x, w13, w2, ids, w, emap, backend="torch")
        for lo, hi in [(0, 1), (3, 8), (17, 18), (40, 64)]:
            assert torch.equal(fused_moe(x[lo:hi], w13, w2, ids[lo:hi], w[lo:hi], emap, backend="torch"),
                               whole[lo:hi]), (lo, hi)
    finally:
        cpu_forms.set_batch_invariant(False)
    if kind in ("float32", "bfloat16"):
        ref = fused_moe_reference(x, w13, w2, ids, w, emap)
        assert float((whole.double() - ref).abs().max() / ref.abs().max()) <= TOL[dtype]


def test_int8_experts_refuse_the_grouped_form():
    w13, w2 = quantize_int8(torch.randn(4, 2 * I, H)), quantize_int8(torch.randn(4, H, I))
    with pytest.raises(ValueError, match="grouped CPU MoE form takes float weights"):
        cpu_moe.fused_moe_cpu(torch.randn(2, H), w13, w2, torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1),
                              form="grouped")


# The interpreter runs every program instance in Python: the full grid in float32, a cut of it in float16.
@pytest.mark.parametrize("T,E,K", TRITON_GRID)
def test_triton_float32(T, E, K):
    check("triton", T, E, K, torch.float32, "random")


# The interpreter's cost grows with the experts a launch touches: 60 experts are the float32 grid's; the
# patterns below run 20 and 21 (even and odd, more than one block of tokens spread thin).
@pytest.mark.parametrize("T,E,K,pattern", [
    (1, 8, 2, "random"), (3, 20, 8, "expert_map"), (64, 8, 2, "one_expert"), (65, 20, 1, "expert_map"),
    (3, 8, 1, "one_expert"), (24, 20, 8, "random"),
    (17, 21, 3, "random"), (5, 21, 7, "expert_map"), (33, 9, 5, "random"), (2, 7, 6, "one_expert"),
])
def test_triton_float16_and_patterns(T, E, K, pattern):
    """float16 over every pattern (float32 runs the patterns in the biases, FP8 and MXFP4 tests below)."""
    check("triton", T, E, K, torch.float16, pattern)


GPT_OSS = GatedAct(alpha=1.702, limit=1.5, up_offset=1.0)     # a low limit, so the clamps bite at these scales


@pytest.mark.parametrize("backend, form", [*(("torch", f) for f in CPU_FORMS), ("triton", None)])
@pytest.mark.parametrize("T,E,K,pattern", [(1, 8, 2, "random"), (17, 21, 3, "expert_map"), (64, 8, 4, "one_expert")])
def test_clamped_swiglu_with_expert_biases(backend, form, T, E, K, pattern):
    """GPT-OSS's experts: biases on gate/up and down, gate clamped above, up both sides, up + 1, alpha 1.702."""
    x, w13, w2, ids, w, emap = make_case(T, E, K, torch.float32, pattern, seed=T)
    x = 3 * x                                                            # pre-activations past the limit
    g = torch.Generator().manual_seed(E)
    b13, b2 = torch.randn(E, 2 * I, generator=g), torch.randn(E, H, generator=g)
    ref = fused_moe_reference(x, w13, w2, ids, w, emap, act=GPT_OSS, b13=b13, b2=b2)
    gu = torch.einsum("th,eih->tei", x.double(), w13.double()) + b13.double()     # [T, E, 2I]
    assert (gu[..., :I] > GPT_OSS.limit).any() and (gu[..., I:] < -GPT_OSS.limit).any()   # clamps bite
    assert not torch.allclose(ref, fused_moe_reference(x, w13, w2, ids, w, emap))          # not plain SwiGLU
    if form is not None:
        got = cpu_moe.fused_moe_cpu(x, w13, w2, ids, w, emap, form=form, act=GPT_OSS, b13=b13, b2=b2)
    else:
        got = fused_moe(x, w13, w2, ids, w, emap, backend=backend, act=GPT_OSS, b13=b13, b2=b2)
    err = float((got.double() - ref).abs().max() / ref.abs().max())
    assert err <= 1e-4, f"{backend}/{form} T={T} E={E} K={K} {pattern}: rel err {err:.2e}"


def test_int8_experts_with_biases_keep_the_activations_dtype(moe_forms):
    """--quantize int8 on GPT-OSS: the biases are added in the GEMMs' dtype, so the down GEMM runs the int8 form
    measured for the compute dtype (a float32 bias would promote it); against the reference on the int8 weights'
    dequantised values, within the activations' own int8 rounding."""
    x, w13, w2, ids, w, emap = make_case(9, 8, 3, torch.bfloat16, "random", seed=4)
    q13, q2 = quantize_int8(w13), quantize_int8(w2)
    g = torch.Generator().manual_seed(1)
    b13, b2 = torch.randn(8, 2 * I, generator=g).bfloat16(), torch.randn(8, H, generator=g).bfloat16()
    ref = fused_moe_reference(x, q13.dequantize(), q2.dequantize(), ids, w, emap, act=GPT_OSS, b13=b13, b2=b2)
    seen = []
    real = cpu_moe.pick_rows
    moe_forms({})
    def spy(n, dtype, weight):                     # the activations each picked form is called with
        form = real(n, dtype, weight)
        return lambda a, wt: seen.append(a.dtype) or form(a, wt)

    cpu_moe.pick_rows = spy
    try:
        got = cpu_moe.fused_moe_cpu(x, q13, q2, ids, w, emap, form="loop", act=GPT_OSS, b13=b13, b2=b2)
    finally:
        cpu_moe.pick_rows = real
    assert set(seen) == {torch.bfloat16} and got.dtype == torch.bfloat16
    assert float((got.double() - ref).abs().max() / ref.abs().max()) < 3e-2
    if native.available():           # float32 inside: only the bf16 activations' own rounding
        got = cpu_moe.fused_moe_cpu(x, q13, q2, ids, w, emap, form="native", act=GPT_OSS, b13=b13, b2=b2)
        assert got.dtype == torch.bfloat16 and float((got.double() - ref).abs().max() / ref.abs().max()) < 1e-2


def test_biases_must_come_together_with_their_shapes():
    x, w13, w2, ids, w, _ = make_case(3, 8, 2, torch.float32, "random")
    with pytest.raises(ValueError, match="biases must come together"):
        fused_moe(x, w13, w2, ids, w, b13=torch.zeros(8, 2 * I))
    with pytest.raises(ValueError, match="biases must come together"):
        fused_moe(x, w13, w2, ids, w, b13=torch.zeros(8, I), b2=torch.zeros(8, H))
    with pytest.raises(ValueError, match="limit must be a positive number"):
        GatedAct(limit=-1.0)


def to_fp8(w: torch.Tensor, block: tuple[int, int]) -> Fp8Weight:
    """Block-scaled e4m3 as DeepSeek-V3 publishes it: per b0 x b1 block, scale = amax / 448."""
    E, R, C = w.shape
    b0, b1 = block
    pad = torch.zeros(E, -(-R // b0) * b0, -(-C // b1) * b1)
    pad[:, :R, :C] = w
    blocks = pad.view(E, pad.shape[1] // b0, b0, pad.shape[2] // b1, b1)
    scales = (blocks.abs().amax(dim=(2, 4)) / 448).clamp(min=1e-12)                 # [E, R / b0, C / b1]
    values = (blocks / scales[:, :, None, :, None]).view_as(pad)[:, :R, :C].to(torch.float8_e4m3fn)
    return Fp8Weight(values.contiguous(), scales, block)


@pytest.mark.parametrize("dtype, block", [(torch.float32, (128, 128)), (torch.float16, (16, 32))])
@pytest.mark.parametrize("T,E,K,pattern", [(1, 8, 2, "random"), (17, 21, 3, "expert_map"), (64, 8, 4, "one_expert")])
def test_triton_keeps_fp8_experts_and_scales_their_tiles(T, E, K, pattern, dtype, block):
    """FP8 experts (one block or many per matrix, blocks cut by the edges) against the reference on their
    dequantised values: the kernel's only rounding is the activations' dtype."""
    x, w13, w2, ids, w, emap = make_case(T, E, K, torch.float32, pattern, seed=T)
    q13, q2 = to_fp8(w13, block), to_fp8(w2, block)
    assert 0 < float((q13.dequantize() - w13).abs().max()) < 0.1 * float(w13.abs().max())   # really FP8
    ref = fused_moe_reference(x, q13.dequantize(), q2.dequantize(), ids, w, emap)
    got = fused_moe(x.to(dtype), q13, q2, ids, w, emap, backend="triton")
    err = float((got.double() - ref).abs().max() / ref.abs().max())
    assert got.dtype == dtype and err <= TOL[dtype], f"T={T} E={E} K={K} {pattern} {dtype} {block}: {err:.2e}"


def to_mxfp4(w: torch.Tensor) -> Mxfp4Weight:
    """[E, R, C] -> MXFP4 as GPT-OSS publishes its experts (blocks [E, R, C / 32, 16], scales [E, R, C / 32])."""
    blocks, scales = mxfp4.quantize(w)
    return Mxfp4Weight(blocks.flatten(-2).contiguous(), scales)


def mxfp4_values(w: Mxfp4Weight) -> torch.Tensor:
    return mxfp4.dequantize(w.blocks.unflatten(-1, (-1, 16)), w.scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,E,K,pattern", [(1, 8, 2, "random"), (17, 21, 3, "expert_map"), (64, 8, 4, "one_expert")])
def test_triton_keeps_mxfp4_experts_and_decodes_their_tiles(T, E, K, pattern, dtype):
    """MXFP4 experts (widths of whole 32-value blocks: H 96, I 64) against the reference on their dequantised
    values (kernels.formats.mxfp4, itself checked against transformers' dequantiser), with GPT-OSS's biases."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, 96, generator=g)
    w13, w2 = torch.randn(E, 128, 96, generator=g) / 10, torch.randn(E, 96, 64, generator=g) / 8
    _, _, _, ids, w, emap = make_case(T, E, K, torch.float32, pattern, seed=T)
    b13, b2 = torch.randn(E, 128, generator=g), torch.randn(E, 96, generator=g)
    q13, q2 = to_mxfp4(w13), to_mxfp4(w2)
    assert q13.shape == (E, 128, 96) and q13.nbytes == E * 128 * (48 + 3)            # 4.25 bits a weight
    ref = fused_moe_reference(x, mxfp4_values(q13), mxfp4_values(q2), ids, w, emap, act=GPT_OSS, b13=b13, b2=b2)
    got = fused_moe(x.to(dtype), q13, q2, ids, w, emap, backend="triton", act=GPT_OSS, b13=b13.to(dtype),
                    b2=b2.to(dtype))
    err = float((got.double() - ref).abs().max() / ref.abs().max())
    assert got.dtype == dtype and err <= TOL[dtype] + (1e-3 if dtype == torch.float16 else 0), \
        f"T={T} E={E} K={K} {pattern} {dtype}: {err:.2e}"


def test_the_kernels_compile_for_real_gpus():
    """Every format, bias and activation variant through Triton's compiler for sm_80 and sm_90 (to Triton IR:
    no GPU needed), in a process without the interpreter, which would accept what the compiler refuses; the
    decode attention's dtypes, sinks and head dims too."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tests.kernels.gpu_compile"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert run.stdout.count("ok ") == 105
    assert run.stdout.count("ok   decode_attention") == 48 and run.stdout.count("ok   combine_splits") == 12


def test_fp8_experts_on_the_cpu_path_are_a_clear_error():
    x, w13, w2, ids, w, _ = make_case(3, 8, 2, torch.float32, "random")
    with pytest.raises(ValueError, match="FP8 and MXFP4 experts are computed by the Triton kernels"):
        fused_moe(x, to_fp8(w13, (16, 16)), to_fp8(w2, (16, 16)), ids, w, backend="torch")
    with pytest.raises(TypeError, match="both be FP8, both MXFP4, or neither"):
        fused_moe(x, to_fp8(w13, (16, 16)), w2, ids, w, backend="triton")


@pytest.mark.parametrize("T,K,E,block_m", [(1, 8, 64, 16), (37, 3, 7, 16), (300, 8, 128, 64), (5, 2, 9, 1)])
def test_the_alignment_puts_every_pair_once_in_blocks_of_its_expert(T, K, E, block_m):
    from kernels.moe_align import moe_align_block_size

    g = torch.Generator().manual_seed(T)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])       # [T, K]
    ids[0, 0] = ids[-1, -1] = -1                                                    # pairs not held here
    a = moe_align_block_size(ids, E, block_m)
    rows = a.sorted_pair_ids.view(-1, block_m)                                      # [blocks, BLOCK_M]
    assert a.num_pairs == T * K and rows.shape[0] == a.block_expert.numel()
    real = a.sorted_pair_ids[a.sorted_pair_ids < T * K].long()
    assert sorted(real.tolist()) == [p for p in range(T * K) if ids.view(-1)[p] >= 0]      # each held pair once
    for block, expert in zip(rows, a.block_expert.tolist(), strict=True):
        pairs = block[block < T * K].long()
        assert (ids.view(-1)[pairs] == expert).all() and len(pairs) > 0
        assert torch.equal(pairs, pairs.sort().values)                            # stable: token order kept


@pytest.mark.parametrize("T,K,E,block_m", [(1, 8, 64, 16), (37, 3, 7, 16), (300, 8, 128, 64), (5, 2, 9, 1),
                                         (4, 2, 3, 16)])
def test_the_device_alignment_is_the_host_one_on_a_fixed_grid(T, K, E, block_m):
    """moe_align_on_device (CUDA graphs) gives the host alignment's rows and block experts, then only padding
    blocks (expert -1, every pair id num_pairs) up to the worst case, whatever the ids: its shapes are T, K, E's."""
    from kernels.moe_align import max_blocks, moe_align_block_size, moe_align_on_device

    g = torch.Generator().manual_seed(T + E)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])       # [T, K]
    ids[0, 0] = ids[-1, -1] = -1
    for case in (ids, torch.zeros_like(ids), torch.full_like(ids, -1)):             # spread, one expert, none here
        host, dev = moe_align_block_size(case, E, block_m), moe_align_on_device(case, E, block_m)
        nb = host.block_expert.numel()
        assert dev.block_expert.numel() == max_blocks(T * K, E, block_m) >= nb and dev.num_pairs == T * K
        assert torch.equal(dev.block_expert[:nb], host.block_expert)
        assert (dev.block_expert[nb:] == -1).all()
        assert torch.equal(dev.sorted_pair_ids[:nb * block_m], host.sorted_pair_ids)
        assert (dev.sorted_pair_ids[nb * block_m:] == T * K).all()


@pytest.mark.parametrize("T,E,K,pattern", [(1, 8, 2, "random"), (17, 21, 3, "expert_map"), (64, 8, 4, "one_expert")])
def test_graph_safe_mode_gives_the_same_bits(T, E, K, pattern, monkeypatch):
    """In graph-safe mode (a CUDA graph's capture) the kernels run the device alignment's worst-case grid and skip
    its empty blocks: the same bits as the host alignment's exact grid."""
    from kernels import triton_moe
    from kernels.graph_safe import graph_safe

    used = []
    on_device = triton_moe.moe_align_on_device
    monkeypatch.setattr(triton_moe, "moe_align_on_device", lambda *a: used.append(a) or on_device(*a))
    x, w13, w2, ids, w, emap = make_case(T, E, K, torch.float32, pattern)
    eager = fused_moe(x, w13, w2, ids, w, emap, backend="triton")
    assert not used                                            # the host alignment outside the mode
    with graph_safe():
        safe = fused_moe(x, w13, w2, ids, w, emap, backend="triton")
    assert len(used) == 1                                      # the device one inside it
    assert torch.equal(eager, safe)


def test_no_pair_held_here_gives_zeros():
    x, w13, w2, ids, w, _ = make_case(5, 8, 2, torch.float32, "random")
    emap = torch.full((8,), -1, dtype=torch.long)
    for backend in ("torch", "triton"):
        assert torch.equal(fused_moe(x, w13, w2, ids, w, emap, backend=backend), torch.zeros_like(x))


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("T,E,K,renorm", [(1, 8, 2, True), (37, 60, 8, False), (64, 60, 4, True), (5, 8, 1, False),
                                          (9, 61, 3, True), (4, 61, 5, True), (7, 60, 6, True), (3, 9, 7, False)])
def test_topk_route(backend, T, E, K, renorm):
    """Any k (3, 5, 6, 7 too: the kernel masks its padded lanes) and odd expert counts."""
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T))
    w, ids = topk_route(logits, K, renorm, backend=backend)
    rw, rids = topk_route_reference(logits, K, renorm)
    assert w.dtype == torch.float32 and w.shape == (T, K)
    assert torch.equal(ids, rids)
    assert torch.allclose(w.double(), rw, rtol=1e-5, atol=1e-7)


def test_bad_inputs_are_clear_errors():
    x, w13, w2, ids, w, _ = make_case(3, 8, 2, torch.float32, "random")
    with pytest.raises(ValueError, match="shapes disagree"):
        fused_moe(x[:, :10], w13, w2, ids, w)
    with pytest.raises(ValueError, match="must both be"):
        fused_moe(x, w13, w2, ids[:, :1], w)
    with pytest.raises(ValueError, match="unknown"):
        fused_moe(x, w13, w2, ids, w, backend="cuda-magic")
    with pytest.raises(TypeError, match="dtypes differ"):
        fused_moe(x.half(), w13, w2, ids, w, backend="triton")


def test_environment_variable_overrides_the_automatic_choice(monkeypatch):
    x, w13, w2, ids, w, _ = make_case(3, 8, 2, torch.float32, "random")
    monkeypatch.setenv("COLIBRI_MOE_BACKEND", "bogus")
    with pytest.raises(ValueError, match="MoE backend 'bogus' is unknown"):
        fused_moe(x, w13, w2, ids, w)
    monkeypatch.setenv("COLIBRI_MOE_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")   # the launcher refuses CPU tensors outside the interpreter
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        fused_moe(x, w13, w2, ids, w)
