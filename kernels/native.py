"""Colibri's native CPU kernels (kernels/native/, built by `make setup`): loaded here when the build exists, one
Python op per kernel, each checked against a float64 reference before it may be used (kernels/cpu_check.py).

    linear(x, w) -> x @ w.T in x's dtype                   w float32 | bfloat16 | Int8Weight (weight-only)
    expert_ffn(xs, counts, w13, w2, act, b13, b2) -> [P, H] float32, each sorted pair's expert FFN
    expert_ffn_rows(xs, counts, w13, w2, act, b13, b2) -> the same over ExpertRows (experts in place, mapped)
    moe_sum_(acc, ys, rows, weights): acc [T, H] float64 += each pair's ys * weight (float32) at its token's row

The ISA level is chosen when the library loads, by CPUID (generic, avx2, avx512, avx512bf16);
COLIBRI_CPU_ISA=LEVEL overrides it, and `use_isa(LEVEL)` switches it in this process (the tests run every
level the machine has). Every output element has one fixed order of float32 operations whatever the row count,
the tile or the thread (kernels/native/gemm.h): batch-invariant by construction.

Shapes: x [n, K], w [Dout, K]; P token-expert pairs sorted by expert, H hidden size, I expert width, E experts.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kernels.activation import SILU, GatedAct
from kernels.expert_rows import ExpertRows
from kernels.quant import Int8Weight

LIBRARY = Path(__file__).resolve().parent / "native" / "_build" / "colibri_native.so"
KINDS = ("float32", "bfloat16", "int8-float32", "int8-bfloat16")     # what the kernels take


def _load() -> str | None:
    """None when loaded; else why not (for the start-up log)."""
    if os.environ.get("COLIBRI_NATIVE") == "off":
        return "COLIBRI_NATIVE=off"
    if not LIBRARY.is_file():
        return f"not built ({LIBRARY} is missing: run `make setup`, which needs g++)"
    try:
        torch.ops.load_library(str(LIBRARY))
    except (OSError, RuntimeError) as exc:
        return f"cannot load {LIBRARY}: {str(exc).splitlines()[0]} (run `make setup` again)"
    try:
        torch.ops.colibri.isa()                          # the CPUID choice, or the override's refusal
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return None


UNAVAILABLE = _load()


def available() -> bool:
    return UNAVAILABLE is None


def build_id() -> str:
    """Which build of the kernels is loaded (its sources' fingerprint from kernels/native_build.py), so that
    forms measured with another build are measured again; 'none' without them."""
    stamp = LIBRARY.parent / "fingerprint"
    if not available():
        return "none"
    return stamp.read_text().strip() if stamp.is_file() else "unknown"


def refused_override() -> str | None:
    """Why COLIBRI_CPU_ISA cannot be honoured (a level this CPU lacks, a name that is none): a start-up error
    for the services, who were asked for it explicitly; None when it is unset or honoured."""
    return UNAVAILABLE if os.environ.get("COLIBRI_CPU_ISA") and UNAVAILABLE and "COLIBRI_CPU_ISA" in UNAVAILABLE \
        else None


def isa() -> str:
    return torch.ops.colibri.isa() if available() else "none"


def use_isa(level: str = "") -> str:
    """Switch this process to `level` ('' = the CPUID choice); a level the CPU lacks is a RuntimeError."""
    return torch.ops.colibri.use_isa(level)


def describe() -> str:
    """For the start-up logs."""
    if not available():
        return f"native CPU kernels: none ({UNAVAILABLE}); the torch forms run"
    chosen = "COLIBRI_CPU_ISA" if os.environ.get("COLIBRI_CPU_ISA") else "CPUID"
    return f"native CPU kernels: {isa()} (by {chosen})"


def linear(x: torch.Tensor, w: torch.Tensor | Int8Weight) -> torch.Tensor:
    """x [n, K] @ w.T -> [n, Dout] in x's dtype (float32 accumulation, one rounding)."""
    if isinstance(w, Int8Weight):
        return torch.ops.colibri.linear(x, w.q, w.scale).to(x.dtype)
    return torch.ops.colibri.linear(x, w).to(x.dtype)


def expert_ffn(xs: torch.Tensor, counts: list[int], w13: torch.Tensor | Int8Weight, w2: torch.Tensor | Int8Weight,
               act: GatedAct = SILU, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """Each pair's expert FFN (pairs sorted by expert, counts[e] of them for local expert e): gate/up, the gated
    activation and down in float32, biases included -> [P, H] float32, not yet weighted."""
    q13, s13 = (w13.q, w13.scale) if isinstance(w13, Int8Weight) else (w13, None)
    q2, s2 = (w2.q, w2.scale) if isinstance(w2, Int8Weight) else (w2, None)
    return torch.ops.colibri.expert_ffn(xs, counts, q13, s13, q2, s2, b13, b2, act.alpha, act.limit, act.up_offset)


def expert_ffn_rows(xs: torch.Tensor, counts: list[int], w13: ExpertRows, w2: ExpertRows, act: GatedAct = SILU,
                    b13: torch.Tensor | None = None, b2: torch.Tensor | None = None) -> torch.Tensor:
    """`expert_ffn` over experts in place (counts[e] pairs of local expert e, as there): only the experts with work
    are handed to the kernel, their row blocks as they lie."""
    active = [e for e, n in enumerate(counts) if n]
    blocks13 = [b for e in active for b in w13.blocks[e]]
    return torch.ops.colibri.expert_ffn_rows(xs, [counts[e] for e in active], active, blocks13,
                                             [len(w13.blocks[e]) for e in active], [w2.blocks[e][0] for e in active],
                                             b13, b2, act.alpha, act.limit, act.up_offset)


def moe_sum_(acc: torch.Tensor, ys: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """acc [T, H] float64 += ys [P, H] float32 times weights [P] (the product in float32) at rows [P]; returns acc.
    The same bits as `acc.index_add_(0, rows, (ys * weights[:, None]).double())`, without its serial scatter."""
    torch.ops.colibri.moe_sum_(acc, ys, rows, weights)
    return acc
