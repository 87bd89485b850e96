"""The near-tie checkpoint of tests/test_same_tokens.py served by fleets started with perturbations (an ISA cap, a
thread count, no forms file), each compared with a two-worker baseline by `where`: which changes move which bits,
and from which step. A tool for the open bug in docs/models.md, not a test.

    python -m tests.near_tie_probe [--caught FILE.pt] [NAME ...]   (every probe when none is named; `--list`)

With `--caught`, a `.pt` file the test kept beside a OneOffDifference's logs, each probe is also compared with the
fleet that computed otherwise there and the one that did not ("tried" and "other"): how many of the prompts' steps
have their logits to the bit, so a probe that gives the odd fleet's bits names the switch. The checkpoint is built
once into $COLIBRI_CACHE_DIR (or a temporary directory) with the test's config and seed.
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
    "batch-invariant": ({}, ["--batch-invariant"]),
    "wire float32": ({}, ["--wire-dtype", "float32"]),
    "block-size 32": ({}, ["--block-size", "32"]),
    "micro-batches 2": ({}, ["--micro-batches", "2"]),
    "transport stream": ({}, ["--transport", "stream"]),
    "max-batch-size 1": ({}, ["--max-batch-size", "1"]),
    "malloc perturb 0xa5": ({"MALLOC_PERTURB_": "165"}, []),     # glibc fills fresh and freed heap memory: bits
    "malloc perturb 0x5a": ({"MALLOC_PERTURB_": "90"}, []),      # that move read memory nobody wrote
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


def against(got: Run, caught: dict) -> str:
    """How many prompt steps `got` has to the bit of the caught first try's two fleets."""
    def same(logits: list[list[bytes]]) -> int:
        pairs = zip(got.logits, logits, strict=True)
        return sum(a == b for mine, theirs in pairs for a, b in zip(mine, theirs, strict=False))
    steps = sum(len(lg) for lg in got.logits)
    return f"; caught: {same(caught['tried'][1])}/{steps} steps those of the fleet that computed otherwise, " \
           f"{same(caught['other'][1])}/{steps} the other's"


def main(args: list[str]) -> int:
    if args == ["--list"]:
        print("\n".join(PROBES))
        return 0
    caught = None
    if args[:1] == ["--caught"]:
        if len(args) < 2:
            print("near_tie_probe: --caught takes the .pt file a OneOffDifference names", file=sys.stderr)
            return 2
        caught, args = torch.load(args[1]), args[2:]
    unknown = [n for n in args if n not in PROBES]
    if unknown:
        print(f"near_tie_probe: no probe {', '.join(unknown)}; --list names them", file=sys.stderr)
        return 2
    path = checkpoint()
    base = serve(path, 2, [])
    said = against(base, caught) if caught else ""
    print(f"baseline (2 workers) against 1 worker: {where(base, serve(path, 1, []))}{said}", flush=True)
    for name in args or list(PROBES):
        env, extra = PROBES[name]
        got = serve(path, 2, extra, env)
        print(f"{name}: {where(base, got)}{against(got, caught) if caught else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
