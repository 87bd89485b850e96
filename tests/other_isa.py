"""The second ATen kernel level `make test` runs the kernel and oracle tests under (ATEN_CPU_CAPABILITY): AVX2
on a machine whose own level is higher (AVX-512, AMX), and torch's portable `default` kernels on an AVX2-only
one, so every machine checks two levels and an AVX-512 one checks the AVX2 paths too. Never a level above the
machine's own: torch would run instructions the CPU does not have."""

from __future__ import annotations

import torch


def other_level() -> str:
    return "default" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT") else "avx2"


if __name__ == "__main__":
    print(other_level())
