"""Measure and install the CPU forms a process will use: the linear forms (`kernels/cpu_forms.py`) for
every weight shape it multiplies by, and the fused-MoE form (`kernels/cpu_moe.py`: per-expert loop or one
grouped GEMM) for every expert shard it holds.

A table loaded from the forms file is reused (a key already there is not measured again); entries that make
no sense for their key are dropped and measured again. `save` runs only when something was measured.

Shapes: E local experts, I expert width, H hidden size, K experts per token, T tokens of a call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass

import torch

from kernels import cpu_forms
from kernels.cpu_moe import MOE_FORMS, fused_moe_cpu, install_moe, moe_candidates, moe_key
from kernels.quant import quantize_int8

# What the winners were chosen among: a forms file measured with other candidates is measured again.
CANDIDATES = "+".join(cpu_forms.FORMS) + "/" + "+".join(MOE_FORMS)


@dataclass(frozen=True)
class MoeShape:
    """One worker's expert shard as the fused MoE sees it: `pairs` experts per token land here on average."""

    experts: int
    width: int
    hidden: int
    pairs: int
    kind: str

    def __post_init__(self) -> None:
        if min(self.experts, self.width, self.hidden, self.pairs) <= 0 or self.pairs > self.experts:
            raise ValueError(f"MoE shape needs positive sizes and pairs <= experts, got {self}")


def _moe_weights(s: MoeShape, g: torch.Generator) -> tuple[object, object, torch.dtype]:
    w13 = torch.randn(s.experts, 2 * s.width, s.hidden, generator=g) * 0.02             # [E, 2I, H]
    w2 = torch.randn(s.experts, s.hidden, s.width, generator=g) * 0.02                  # [E, H, I]
    if s.kind.startswith("int8-"):
        return quantize_int8(w13), quantize_int8(w2), getattr(torch, s.kind.removeprefix("int8-"))
    dtype = getattr(torch, s.kind)
    return w13.to(dtype), w2.to(dtype), dtype


def measure_moe(shapes: Iterable[MoeShape], table: MutableMapping[str, str], max_rows: int = cpu_forms.BUCKETS[-1],
                min_seconds: float = 0.02) -> list[str]:
    """Race the MoE forms for each shard shape at each row bucket up to max_rows; fills `table`."""
    measured = []
    g = torch.Generator().manual_seed(0)
    for s in dict.fromkeys(shapes):
        names = moe_candidates(s.kind)
        todo = [b for b in cpu_forms.BUCKETS if b <= cpu_forms.bucket(max_rows)
                and moe_key(s.experts, s.width, s.hidden, s.kind, b) not in table]
        if len(names) < 2 or not todo:
            continue
        w13, w2, x_dtype = _moe_weights(s, g)
        for b in todo:
            x = torch.randn(b, s.hidden, generator=g).to(x_dtype)                          # [T, H]
            ids = torch.rand(b, s.experts, generator=g).argsort(dim=1)[:, :s.pairs]          # [T, K] distinct
            weights = torch.rand(b, s.pairs, generator=g)                                   # [T, K]
            k = moe_key(s.experts, s.width, s.hidden, s.kind, b)
            table[k] = cpu_forms.race(
                names, "loop", lambda name, call, x=x, ids=ids, weights=weights, w13=w13, w2=w2: fused_moe_cpu(
                    x, w13, w2, ids, weights, form=name), min_seconds)
            measured.append(k)
    return measured


def _valid(k: str, form: str) -> bool:
    if k.startswith("moe:"):
        try:
            _, _, weight_kind, rows = k.split(":")
            return form in moe_candidates(weight_kind) and int(rows) in cpu_forms.BUCKETS
        except ValueError:
            return False
    return cpu_forms.valid(k, form)


def tune(shapes: Iterable[tuple[int, int, str]], table: MutableMapping[str, str], save: Callable[[], None],
         max_rows: int = cpu_forms.BUCKETS[-1], moe: Iterable[MoeShape] = ()) -> list[str]:
    """Measure what `table` lacks, `save` if anything was measured, install the winners; returns the keys
    measured now."""
    for k in [k for k, form in table.items() if not _valid(k, form)]:
        del table[k]
    measured = cpu_forms.measure(shapes, table, max_rows=max_rows) + measure_moe(moe, table, max_rows=max_rows)
    if measured:
        save()
    cpu_forms.install({k: v for k, v in table.items() if not k.startswith("moe:")})
    install_moe({k: v for k, v in table.items() if k.startswith("moe:")})
    return measured
