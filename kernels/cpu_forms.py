"""The forms of y = x @ W.T on a CPU, and the measurement that picks one per weight shape and row count.

CPUs disagree: on an AVX2-only EPYC bf16 arithmetic is emulated and an upcast to float32 wins from ≈8 rows,
on a Xeon with AMX / AVX512-BF16 oneDNN's bf16 GEMM wins at every row count. So nothing is hard-coded:
`measure` times every candidate for the model's real shapes at row buckets 1, 2, 4, ... 64, and
`install` makes `kernels.cpu_linear.linear` use the winners. Persisting them (keyed by CPU, ISA flags and
torch version) is the caller's business: `measure` reads and fills any mutable mapping it is given.

Shapes: n rows of x, Din input features, Dout output features; W [Dout, Din].
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, MutableMapping

import torch
import torch.nn.functional as F

Form = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]      # (x [n, Din], W [Dout, Din]) -> [n, Dout]


def _mv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mv(w, x[0])[None]                                # one row: a streaming matrix-vector


def _gemv_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t()                                 # W @ x.T keeps W streaming, no packing


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)                                         # oneDNN / MKL GEMM in W's dtype


def _upcast(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float()).to(x.dtype)             # float32 GEMM on a converted copy of W


FORMS: dict[str, Form] = {"mv": _mv, "gemv_t": _gemv_t, "linear": _linear, "upcast": _upcast}
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(n: int) -> int:
    """The row bucket of n rows: the next power of two, at most the largest bucket."""
    b = 1
    while b < n and b < BUCKETS[-1]:
        b *= 2
    return b


def key(dout: int, din: int, dtype: torch.dtype, rows: int) -> str:
    return f"{dout}x{din}:{str(dtype).removeprefix('torch.')}:{rows}"


def candidates(dtype: torch.dtype, rows: int) -> list[str]:
    out = ["linear"]
    if rows == 1:
        out.append("mv")
    if rows <= 8:
        out.append("gemv_t")
    if dtype in (torch.bfloat16, torch.float16):
        out.append("upcast")
    return out


def default_form(dtype: torch.dtype, rows: int) -> str:
    """What to use before (or without) a measurement: the forms measured on the AVX2 dev machine."""
    if rows == 1:
        return "mv"
    if dtype == torch.bfloat16 and rows >= 8:
        return "upcast"
    if dtype == torch.float32 and rows <= 4:
        return "gemv_t"
    return "linear"


_TABLE: dict[str, str] = {}


def install(table: dict[str, str]) -> None:
    """Make `linear` use these winners (keys from `key`); shapes not in it keep the defaults."""
    unknown = set(table.values()) - set(FORMS)
    if unknown:
        raise ValueError(f"unknown CPU linear forms {sorted(unknown)}; known: {', '.join(FORMS)}")
    _TABLE.update(table)


def pick(w: torch.Tensor, rows: int) -> Form:
    b = bucket(rows)
    name = _TABLE.get(key(w.shape[0], w.shape[1], w.dtype, b)) or default_form(w.dtype, rows)
    return FORMS[name if rows == 1 or name != "mv" else "gemv_t"]


def _time(form: Form, x: torch.Tensor, weights: list[torch.Tensor], min_seconds: float) -> float:
    """Median seconds per call, cycling through copies of W so it streams from memory as in serving."""
    times: list[float] = []
    deadline = time.perf_counter() + min_seconds
    i = 0
    form(x, weights[0])                                            # warm-up (first-call allocations)
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
        w = weights[i % len(weights)]
        t0 = time.perf_counter()
        form(x, w)
        times.append(time.perf_counter() - t0)
        i += 1
    times.sort()
    return times[len(times) // 2]


def measure(shapes: Iterable[tuple[int, int, torch.dtype]], table: MutableMapping[str, str],
            max_rows: int = BUCKETS[-1], stream_bytes: int = 64 * 2**20, min_seconds: float = 0.02,
            progress: Callable[[str], None] | None = None) -> list[str]:
    """Time the candidates of every (Dout, Din, dtype) at each row bucket up to max_rows, filling `table`
    with the winners. Entries already in `table` are kept (a reused file measures nothing). Returns the
    keys it measured."""
    measured = []
    g = torch.Generator().manual_seed(0)
    for dout, din, dtype in dict.fromkeys(shapes):
        todo = [b for b in BUCKETS if b <= bucket(max_rows) and key(dout, din, dtype, b) not in table]
        if not todo:
            continue
        copies = max(1, min(64, stream_bytes // max(1, dout * din * dtype.itemsize)))
        weights = [torch.randn(dout, din, generator=g).to(dtype) for _ in range(copies)]   # [Dout, Din] each
        for b in todo:
            x = torch.randn(b, din, generator=g).to(dtype)                                # [n, Din]
            seconds = {name: _time(FORMS[name], x, weights, min_seconds) for name in candidates(dtype, b)}
            table[key(dout, din, dtype, b)] = min(seconds, key=seconds.__getitem__)
            measured.append(key(dout, din, dtype, b))
        if progress is not None:
            progress(f"{dout}x{din} {str(dtype).removeprefix('torch.')}")
    return measured


def describe(table: dict[str, str]) -> str:
    """One line per shape: which form won at which rows (for the start-up log)."""
    by_shape: dict[str, list[str]] = {}
    for k, form in sorted(table.items(), key=lambda kv: (kv[0].rsplit(":", 1)[0], int(kv[0].rsplit(":", 1)[1]))):
        shape, rows = k.rsplit(":", 1)
        by_shape.setdefault(shape, []).append(f"{rows}:{form}")
    return "; ".join(f"{shape} {' '.join(v)}" for shape, v in by_shape.items())


def tune(shapes: Iterable[tuple[int, int, torch.dtype]], table: MutableMapping[str, str],
         save: Callable[[], None], max_rows: int = BUCKETS[-1]) -> list[str]:
    """Measure what `table` lacks (a table loaded from a file is reused), `save` if anything was measured,
    and install the winners. Returns the keys measured now."""
    measured = measure(shapes, table, max_rows=max_rows)
    if measured:
        save()
    install(dict(table))
    return measured
