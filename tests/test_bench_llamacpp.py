"""The llama.cpp peer of `make bench` (benchmarks/llamacpp.py): its table read as llama-batched-bench prints it,
and the ways a user points at a build refused clearly when they are wrong."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.llamacpp import Peer, find_peer, measure, parse_batched_bench, parse_ggufs
from kernels.omp_policy import MARK

# The tail of a real `llama-batched-bench -npp 16 -ntg 64 -npl 1,8,32 -t 2` run on the bench model (bf16, an AVX2
# EPYC), log lines included.
REAL = """\
0.01.179.725 W llama_context: n_ctx is not divisible by n_seq_max - rounding down to 8192

llama_batched_bench: n_kv_max = 8192, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0, \
is_tg_separate = 0, n_gpu_layers = -1, n_threads = 2, n_threads_batch = 2

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |     64 |    1 |     80 |    0.137 |   116.50 |    1.441 |    44.42 |    1.578 |    50.69 |
|    16 |     64 |    8 |    640 |    0.827 |   154.81 |    8.213 |    62.34 |    9.040 |    70.80 |
|    16 |     64 |   32 |   2560 |    3.454 |   148.23 |   22.365 |    91.57 |   25.819 |    99.15 |
"""


def test_the_table_gives_decode_and_output_rates() -> None:
    rates = parse_batched_bench(REAL)
    assert sorted(rates) == [1, 8, 32]
    assert rates[1].decode_tokens_per_s == 44.42
    assert rates[8].output_tokens_per_s == pytest.approx(8 * 64 / 9.040)      # prefill included
    assert rates[32].output_tokens_per_s == pytest.approx(32 * 64 / 25.819)


def test_a_failed_run_is_an_error_with_its_output() -> None:
    with pytest.raises(ValueError, match="error loading model"):
        parse_batched_bench("llama_model_load: error loading model: tensor 'x' has wrong shape\n")


def test_ggufs_spec() -> None:
    assert parse_ggufs("bf16=/a.gguf, q8_0=/b.gguf") == {"bf16": Path("/a.gguf"), "q8_0": Path("/b.gguf")}
    with pytest.raises(ValueError, match="QUANT=PATH"):
        parse_ggufs("/a.gguf")


def test_a_build_folder_without_the_binary_or_ggufs_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="holds llama-batched-bench"):
        Peer(bin_dir=tmp_path, ggufs={"bf16": tmp_path / "m.gguf"})
    exe = tmp_path / "llama-batched-bench"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(ValueError, match="does not exist"):
        Peer(bin_dir=tmp_path, ggufs={"bf16": tmp_path / "missing.gguf"})
    with pytest.raises(ValueError, match="q8_0"):
        Peer(bin_dir=tmp_path, ggufs={"q4": tmp_path / "m.gguf"})


def test_the_environment_points_at_a_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    exe = tmp_path / "llama-batched-bench"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("COLIBRI_LLAMACPP_BIN", str(tmp_path))
    monkeypatch.setenv("COLIBRI_LLAMACPP_GGUF", f"bf16={tmp_path / 'm.gguf'}")
    peer, line = find_peer()
    assert peer is not None and peer.bin_dir == tmp_path and str(tmp_path) in line
    monkeypatch.delenv("COLIBRI_LLAMACPP_BIN")
    monkeypatch.setenv("COLIBRI_LLAMACPP_PEER", str(tmp_path / "m.gguf"))      # not executable
    with pytest.raises(ValueError, match="not an executable"):
        find_peer()
    assert os.access(exe, os.X_OK)


@pytest.mark.parametrize("ours", [True, False])
def test_llamacpp_runs_with_the_users_openmp_policy_not_colibris(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 ours: bool) -> None:
    """Colibri sets OMP_WAIT_POLICY=PASSIVE for itself (kernels/omp_policy.py); llama.cpp, an OpenMP program, slept
    between its graph's ops under it (0.55-0.65x its one-stream speed on an AVX-512 EPYC). The peer runs with the
    policy the user gave, or none, and the results name a policy that reached it."""
    seen = tmp_path / "policy"
    exe = tmp_path / "llama-batched-bench"
    exe.write_text(f"#!/bin/sh\necho \"${{OMP_WAIT_POLICY:-unset}}\" > {seen}\ncat <<'TABLE'\n{REAL}TABLE\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    if ours:
        monkeypatch.setenv(MARK, "PASSIVE")
    else:
        monkeypatch.delenv(MARK, raising=False)
    got = measure(Peer(bin_dir=tmp_path, ggufs={"bf16": tmp_path / "m.gguf"}), tmp_path, [1, 8, 32], 16, 64, 2)
    assert got["bf16"]["rows"][8].streams == 8
    assert seen.read_text().strip() == ("unset" if ours else "PASSIVE")
    # the results say so where the user's policy reached llama.cpp (a session's runs took PASSIVE for Colibri's own)
    named = "OMP_WAIT_POLICY=PASSIVE from the environment (its OpenMP threads sleep" in got["bf16"]["source"]
    assert named != ours, got["bf16"]["source"]


@pytest.mark.parametrize("module", ["kernels", "colibri"])
@pytest.mark.parametrize("policy", [None, "ACTIVE"])
def test_colibri_marks_only_the_policy_it_sets(module: str, policy: str | None) -> None:
    """`import kernels` (or `import colibri`, which may run first) sets PASSIVE where the user set no policy, and
    marks it as Colibri's; the peer's environment then has none. A user's policy is left unmarked and passed on, and
    so is one the user sets later."""
    code = (f"import os, {module}\nfrom kernels import users_environment\n"
            "print(os.environ.get('OMP_WAIT_POLICY'), users_environment().get('OMP_WAIT_POLICY'))\n"
            "os.environ['OMP_WAIT_POLICY'] = 'ACTIVE'\nprint(users_environment().get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", MARK)}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stderr
    first, later = out.stdout.splitlines()
    assert first == ("ACTIVE ACTIVE" if policy else "PASSIVE None")
    assert later == "ACTIVE"
