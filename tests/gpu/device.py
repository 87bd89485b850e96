"""Where the GPU tests run: the GPU, or, with COLIBRI_GPU_DRY_RUN=1 on a machine without one, the CPU under the
Triton interpreter (float32 and float16 only: the interpreter's bf16 is wrong), so the tests' own code can be
checked where no GPU is lent. Without either they are skipped (CI has no GPU), unless COLIBRI_REQUIRE_GPU=1 (`make
test-gpu`, benchmarks/gpu_check.sh): then they fail, so a CPU build of torch or a driver mismatch cannot pass as
skipped tests."""

from __future__ import annotations

import os

import torch

HAS_GPU = torch.cuda.is_available()
REQUIRED = os.environ.get("COLIBRI_REQUIRE_GPU") == "1"        # make test-gpu: no GPU is a failure, not a skip
DRY_RUN = os.environ.get("COLIBRI_GPU_DRY_RUN") == "1" and not HAS_GPU
DEVICE = torch.device("cuda") if HAS_GPU else torch.device("cpu")
DTYPES = [torch.float32, torch.float16, *([torch.bfloat16] if HAS_GPU else [])]


def on(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(DEVICE)
