"""The GPU tests (`make test-gpu`): skipped where no CUDA GPU is visible, unless COLIBRI_GPU_DRY_RUN=1 (tests/gpu/
device.py), which runs them on the CPU under the Triton interpreter."""

from __future__ import annotations

import os

import pytest

from tests.gpu.device import DRY_RUN, HAS_GPU, REQUIRED

if DRY_RUN:                                   # before any @triton.jit is defined
    os.environ["TRITON_INTERPRET"] = "1"
    from tests.kernels import interpreter_patch

    interpreter_patch.install()


@pytest.fixture(autouse=True)
def gpu_or_skip():
    if not HAS_GPU and REQUIRED:
        import torch

        pytest.fail(f"COLIBRI_REQUIRE_GPU=1 but torch {torch.__version__} sees no CUDA GPU (CUDA build: "
                    f"{torch.version.cuda or 'no'}); install a CUDA build of torch, or check the driver (nvidia-smi)")
    if not HAS_GPU and not DRY_RUN:
        pytest.skip("no CUDA GPU visible here (make test-gpu runs these where one is)")
