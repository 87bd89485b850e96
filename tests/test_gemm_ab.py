"""benchmarks/gemm_ab.py: the A/B driver compiles two texts of kernels/native/gemm.h, times both on the same weights
and says whether they wrote the same bits (so an A/B that was meant to keep the numerics shows when it did not)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gemm_ab
from kernels.native_build import compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler here")
# the driver's own ISA level where the CPU runs it (the generic level's W8A8 is a scalar loop, slow to time)
LEVEL = "avx2" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else "generic"


def test_one_source_twice_gives_the_same_bits_and_a_changed_product_does_not(tmp_path):
    text = (gemm_ab.ROOT / gemm_ab.GEMM).read_text()
    changed = text.replace("acc[i][j] += xv * wv[j];", "acc[i][j] += xv * wv[j] * 1.0000002f;")   # float path
    changed = changed.replace("= (float(sums[i][j]) * xs[i]) * ws[j];", "= (float(sums[i][j]) * xs[i]) * ws[j] * "
                              "1.0000002f;")                                                      # W8A8 path
    assert changed.count("1.0000002f") == 3
    same = gemm_ab.build(text, text, LEVEL, compiler(), tmp_path / "same")
    other = gemm_ab.build(text, changed, LEVEL, compiler(), tmp_path / "other")
    for exe, want in ((same, True), (other, False)):
        got = gemm_ab.run(exe, "linear", "bf16", 3, 1, 1)
        assert got["same"] is want
        for v in ("A", "B"):
            best, mean, gbs = got[v]
            assert 0 < best <= mean and gbs > 0
        assert got["huge_mib"] is None or got["huge_mib"] >= 0
        got = gemm_ab.run(exe, "layer", "w8a8", 2, 2, 1)     # the W8A8 entry point, whole experts on 2 threads
        assert got["same"] is want


def test_bad_choices_are_refused_with_what_exists():
    out = subprocess.run([sys.executable, "-m", "benchmarks.gemm_ab", "--kinds", "fp4"], capture_output=True,
                         text=True, cwd=gemm_ab.ROOT)
    assert out.returncode != 0 and "unknown fp4" in out.stderr and "bf16, int8, int8b, w8a8" in out.stderr
    out = subprocess.run([sys.executable, "-m", "benchmarks.gemm_ab", "--base", "no-such-rev"], capture_output=True,
                         text=True, cwd=gemm_ab.ROOT)
    assert out.returncode != 0 and "cannot read kernels/native/gemm.h at 'no-such-rev'" in out.stderr
    out = subprocess.run([sys.executable, "-m", "benchmarks.gemm_ab", "--rows", "1,65"], capture_output=True,
                         text=True, cwd=gemm_ab.ROOT)
    assert out.returncode != 0 and "--rows takes row counts 1-64" in out.stderr


def test_each_level_is_compiled_with_the_lanes_of_its_own_unit():
    """The amx level's unit defines 16 lanes (its float path is the avx512bf16 code); the driver once gave every
    level not named avx512* 8, so an A/B at --level amx timed the AVX2-shaped tiles instead."""
    from kernels.native_build import levels

    for level, flags in levels().items():
        assert gemm_ab.lanes(level) == (16 if "-mavx512f" in flags else 8), level
    assert gemm_ab.lanes("amx") == 16


def test_bf16_products_are_timed_where_the_level_has_them(tmp_path):
    """`--kinds bf16dp` links dpbf16.h's VDPBF16PS linear into both builds: the same text gives the same bits, a
    changed one does not; a level without AVX512-BF16 is refused before anything is compiled."""
    text = (gemm_ab.ROOT / gemm_ab.GEMM).read_text()
    dp = (gemm_ab.ROOT / gemm_ab.DPBF16).read_text()
    with pytest.raises(SystemExit, match="bf16dp needs a level with AVX512-BF16"):
        gemm_ab.build(text, text, "avx2", compiler(), tmp_path / "refused", (dp, dp))
    if "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AVX512-BF16")
    changed = dp.replace("lanes_sum((fvec)acc[i][j]);", "lanes_sum((fvec)acc[i][j]) * 1.0000002f;")
    assert changed != dp
    same = gemm_ab.build(text, text, "avx512bf16", compiler(), tmp_path / "same", (dp, dp))
    other = gemm_ab.build(text, text, "avx512bf16", compiler(), tmp_path / "other", (dp, changed))
    for exe, want in ((same, True), (other, False)):
        for mode in ("linear", "layer"):
            got = gemm_ab.run(exe, mode, "bf16dp", 3, 2, 1)
            assert got["same"] is want, mode
            assert 0 < got["B"][0] <= got["B"][1]


def test_the_amx_int8_tiles_are_timed_against_the_lanes_on_vectors(tmp_path):
    """`--x16-tiles` builds B with the amx level's weight-only int8 against bf16 x (amx_x16.h: AMX int8 tiles, exact
    block totals), A with the vector int16 form's lanes: both run int8b, and their bits differ (were B built without
    the tiles, they would not); a level without AMX is refused before anything is compiled."""
    from kernels import native

    text = (gemm_ab.ROOT / gemm_ab.GEMM).read_text()
    with pytest.raises(SystemExit, match="--x16-tiles needs the amx level"):
        gemm_ab.build(text, text, "avx2", compiler(), tmp_path / "refused", tiles=True)
    if not (native.available() and native.isa() == "amx"):
        pytest.skip("the native kernels do not run the amx level here")
    exe = gemm_ab.build(text, text, "amx", compiler(), tmp_path / "tiles", tiles=True)
    for mode, rows in (("layer", 1), ("layer", 4), ("linear", 3)):
        got = gemm_ab.run(exe, mode, "int8b", rows, 2, 1)
        assert got["same"] is False, (mode, rows)
        assert 0 < got["B"][0] <= got["B"][1]
