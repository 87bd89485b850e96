"""The native kernel levels this machine can run (`native.use_isa`), for the kernel tests: every op is checked at
each of them (the `level` fixture, tests/kernels/conftest.py)."""

from __future__ import annotations

import pytest

from kernels import native

LEVELS = ("generic", "avx2", "avx512", "avx512bf16", "amx")


def runnable_levels() -> list[str]:
    if not native.available():
        return []
    out = []
    for level in LEVELS:
        try:
            native.use_isa(level)
            out.append(level)
        except RuntimeError:
            pass
    native.use_isa("")
    return out


RUNNABLE = runnable_levels()
needs_native = pytest.mark.skipif(not native.available(), reason=f"native kernels: {native.UNAVAILABLE}")
