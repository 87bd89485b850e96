"""The second kernel levels `make test` runs the kernel and oracle tests under:

- ATen's (ATEN_CPU_CAPABILITY): AVX2 on a machine whose own level is higher (AVX-512, AMX), and torch's
  portable `default` kernels on an AVX2-only one;
- Colibri's native kernels' (COLIBRI_CPU_ISA): the level below the one CPUID picks (amx -> avx512bf16 ->
  avx512 -> avx2 -> generic), so the override and a second native path run through the services too.

So every machine checks two levels of each and an AVX-512 one checks the AVX2 paths too. Never a level above
the machine's own: it would run instructions the CPU does not have.

    python -m tests.other_isa    ->  ATEN_CPU_CAPABILITY=... COLIBRI_CPU_ISA=...  (COLIBRI_CPU_ISA only where
                                     the native kernels are built)
"""

from __future__ import annotations

import torch

NATIVE_BELOW = {"amx": "avx512bf16", "avx512bf16": "avx512", "avx512": "avx2", "avx2": "generic",
                "generic": "generic"}


def other_level() -> str:
    return "default" if torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT") else "avx2"


def other_native_level() -> str | None:
    from kernels import native

    return NATIVE_BELOW[native.isa()] if native.available() else None


if __name__ == "__main__":
    native_level = other_native_level()
    print(f"ATEN_CPU_CAPABILITY={other_level()}" + (f" COLIBRI_CPU_ISA={native_level}" if native_level else ""))
