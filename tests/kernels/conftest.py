"""Kernel tests run the Triton kernels on CPU tensors through the interpreter."""

import os

# Must be set before any @triton.jit function is defined (the kernels are imported lazily, after this).
os.environ["TRITON_INTERPRET"] = "1"

from tests.kernels import interpreter_patch  # noqa: E402

interpreter_patch.install()
