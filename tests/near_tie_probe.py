"""The near-tie checkpoint of tests/test_same_tokens.py served by fleets started with perturbations (an ISA cap, a
thread count, no forms file), each compared with a two-worker baseline by `where`: which changes move which bits,
and from which step. A tool for the open bug in docs/models.md, not a test.

    python -m tests.near_tie_probe [NAME ...]      (every probe when none is named; `--list` names them)

The checkpoint is built once into $COLIBRI_CACHE_DIR (or a temporary directory) with the test's config and seed.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from colibri.client import Client
from tests.conftest import fleet
from tests.models import build_model, save_checkpoint
from tests.test_same_tokens import PROMPTS, TOKENS, Run, near_tie_config, where

PROBES: dict[str, tuple[dict[str, str], list[str]]] = {
    "ATEN avx2": ({"ATEN_CPU_CAPABILITY": "avx2"}, []),
    "ATEN avx512": ({"ATEN_CPU_CAPABILITY": "avx512"}, []),
    "native avx512bf16": ({"COLIBRI_CPU_ISA": "avx512bf16"}, []),
    "native avx512": ({"COLIBRI_CPU_ISA": "avx512"}, []),
    "oneDNN without AMX": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, []),
    "MKL AVX2": ({"MKL_ENABLE_INSTRUCTIONS": "AVX2"}, []),
    "MKL CBWR COMPATIBLE": ({"MKL_CBWR": "COMPATIBLE"}, []),
    "OMP 1": ({"OMP_NUM_THREADS": "1"}, []),
    "cpu-forms off": ({}, ["--cpu-forms", "off"]),
}


def checkpoint() -> Path:
    path = Path(os.environ.get("COLIBRI_CACHE_DIR") or tempfile.gettempdir()) / "near-tie-probe" / "qwen3-bf16"
    if not path.exists():
        save_checkpoint(build_model(near_tie_config(), seed=7, std=0.05, dtype=torch.bfloat16), path)
    return path


def serve(path: Path, workers: int, extra: list[str], env: dict[str, str] | None = None) -> Run:
    """The test's prompts one after another on a fleet exec'd with `env` (so every variable reaches torch's start)."""
    with fleet(path, workers, ["--dtype", "bfloat16", *extra], env=env, exec_=True) as (addr, _):
        client = Client(addr)
        got = [client.generate(p, TOKENS, return_logits=True) for p in PROMPTS]
    return Run([r.token_ids for r in got], [[x.tobytes() for x in r.logits] for r in got], "")


def main(names: list[str]) -> int:
    if names == ["--list"]:
        print("\n".join(PROBES))
        return 0
    unknown = [n for n in names if n not in PROBES]
    if unknown:
        print(f"near_tie_probe: no probe {', '.join(unknown)}; --list names them", file=sys.stderr)
        return 2
    path = checkpoint()
    base = serve(path, 2, [])
    print(f"baseline (2 workers) against 1 worker: {where(base, serve(path, 1, []))}", flush=True)
    for name in names or list(PROBES):
        env, extra = PROBES[name]
        print(f"{name}: {where(base, serve(path, 2, extra, env))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
