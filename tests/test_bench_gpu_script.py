"""`make bench-gpu` and the GPU profile cannot run here (no GPU), so their scripts run at toy sizes on the CPU under
the Triton interpreter: the same timing, roofline, profiling and serving code, so they work when a GPU is lent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch


def test_the_gpu_benchmark_runs_end_to_end_at_toy_sizes(oracles, tmp_path):
    out = tmp_path / "gpu.md"
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--shapes", "toy",
                          "--tokens", "1,3", "--runs", "1", "--model", str(oracles["qwen3_moe"].path),
                          "--streams", "1,2", "--max-tokens", "3", "--prompt-len", "4", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    text = out.read_text()
    assert "## Fused MoE (float32, Triton) against the read roofline" in text
    moe_rows = [line for line in text.splitlines() if line.startswith("| toy ")]
    assert [r.split("|")[2].strip() for r in moe_rows] == ["1", "3"]
    for engine in ("transformers", "colibri in-process", "colibri in-process --enforce-eager",
                   "colibri serve, 2 workers"):
        rows = [line for line in text.splitlines() if line.startswith("|") and line.split("|")[1].strip() == engine]
        assert [r.split("|")[2].strip() for r in rows] == ["1", "2"], text
        assert all(float(r.split("|")[3]) > 0 for r in rows)


def test_skip_moe_leaves_the_kernel_part_out(tmp_path):
    """--skip-moe (a long-context serving run alone): no fused-MoE section; here with --skip-serving, the header."""
    out = tmp_path / "gpu.md"
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--skip-moe", "--skip-serving",
                          "--out", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# GPU benchmark") and "Command: `python -m benchmarks.gpu --device cpu --skip-moe" in text
    assert "Fused MoE" not in text and "## Serving" not in text


def test_the_gpu_profile_runs_end_to_end_at_toy_sizes(oracles):
    """benchmarks.gpu_profile, as the GPU runs it, on the CPU: the profiler's tables for the fused MoE and for
    decode steps taken on the engine's own thread (a profiler started elsewhere records none of them)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu_profile", "--device", "cpu", "--shape", "toy",
                          "--tokens", "1,3", "--calls", "2", "--model", str(oracles["qwen3_moe"].path),
                          "--streams", "1,2", "--steps", "3", "--enforce-eager"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "### fused MoE toy, T=1:" in out and "### fused MoE toy, T=3:" in out
    for c in (1, 2):
        head = f"### engine float32 on cpu (op by op), {c} streams: 3 decode steps in "
        assert head in out, out[-3000:]
        table = out.split(head)[1].split("###")[0]
        assert "Self CPU time total" in table and "aten::" in table          # the engine thread's ops were seen
    assert "forward" in out and "schedule" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so(capsys):
    from benchmarks.gpu import main

    assert main([]) == 2                               # before any work: the CLI's own answer, in-process
    err = capsys.readouterr().err
    assert "no usable CUDA GPU" in err and "Traceback" not in err
