"""Kernel tests run the Triton kernels on CPU tensors through the interpreter."""

import os

# Must be set before any @triton.jit function is defined (the kernels are imported lazily, after this).
os.environ["TRITON_INTERPRET"] = "1"

from tests.kernels import interpreter_patch  # noqa: E402

interpreter_patch.install()

import pytest  # noqa: E402

from kernels import native  # noqa: E402
from tests.kernels.levels import RUNNABLE  # noqa: E402


@pytest.fixture(params=RUNNABLE or ["none"])
def level(request):
    """Each native kernel level this machine can run, switched on for the test (skipped without the kernels)."""
    if request.param == "none":
        pytest.skip(f"native kernels: {native.UNAVAILABLE}")
    native.use_isa(request.param)
    yield request.param
    native.use_isa("")
