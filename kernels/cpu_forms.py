"""The forms of y = x @ W.T on a CPU, and the measurement that picks one per weight shape and row count.

CPUs disagree: on an AVX2-only EPYC bf16 arithmetic is emulated and an upcast to float32 wins from ≈8 rows,
on a Xeon with AMX / AVX512-BF16 oneDNN's bf16 GEMM wins at every row count. So nothing is hard-coded:
`measure` times every candidate for the model's real shapes at row buckets 1, 2, 4, ... 64, and
`install` makes `kernels.cpu_linear.linear` use the winners. Persisting them (keyed by CPU, ISA flags and
torch version) is the caller's business: `measure` reads and fills any mutable mapping it is given.

A weight's *kind* names what the forms see: its dtype ("float32", "bfloat16"), or "int8-<activation
dtype>" for an `Int8Weight` (kernels/quant.py) multiplied by activations of that dtype.

Shapes: n rows of x, Din input features, Dout output features; W [Dout, Din].
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, MutableMapping

import torch
import torch.nn.functional as F

from kernels.quant import Int8Weight, quantize_int8, quantize_rows

Weight = torch.Tensor | Int8Weight
Form = Callable[[torch.Tensor, Weight], torch.Tensor]            # (x [n, Din], W [Dout, Din]) -> [n, Dout]


def _mv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mv(w, x[0])[None]                                # one row: a streaming matrix-vector


def _gemv_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t()                                 # W @ x.T keeps W streaming, no packing


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)                                         # oneDNN / MKL GEMM in W's dtype


def _upcast(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float()).to(x.dtype)             # float32 GEMM on a converted copy of W


def _int8_pack(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    return torch._weight_int8pack_mm(x, w.q, w.scale.to(x.dtype))   # int8 weights, activations as they are


def _int8_pack_bf16(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """float32 activations through the bf16 int8 kernel: on an AVX2 CPU `_weight_int8pack_mm` moves ≈8-19 GB/s
    of int8 weights with bf16 activations and ≈1.3-2 GB/s with float32 ones (measured at 1 row)."""
    return torch._weight_int8pack_mm(x.bfloat16(), w.q, w.scale.bfloat16()).to(x.dtype)


def _int8_intmm(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    xq, xs = quantize_rows(x)                                     # [n, Din] int8, [n] per-row scales
    return (torch._int_mm(xq, w.q.t()).float() * xs[:, None] * w.scale).to(x.dtype)   # int32 accumulation


def _int8_dequant(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    return (F.linear(x.float(), w.q.float()) * w.scale).to(x.dtype)   # float32 GEMM on a converted copy


FORMS: dict[str, Form] = {"mv": _mv, "gemv_t": _gemv_t, "linear": _linear, "upcast": _upcast,
                          "int8_pack": _int8_pack, "int8_pack_bf16": _int8_pack_bf16, "int8_intmm": _int8_intmm,
                          "int8_dequant": _int8_dequant}
INT8_FORMS = ("int8_pack", "int8_pack_bf16", "int8_intmm", "int8_dequant")
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(n: int) -> int:
    """The row bucket of n rows: the next power of two, at most the largest bucket."""
    b = 1
    while b < n and b < BUCKETS[-1]:
        b *= 2
    return b


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weight_kind(int8: bool, dtype: torch.dtype) -> str:
    """The kind of a weight held in `dtype`, or held as int8 and multiplied by `dtype` activations."""
    return f"int8-{dtype_name(dtype)}" if int8 else dtype_name(dtype)


def kind(w: Weight, x_dtype: torch.dtype) -> str:
    int8 = isinstance(w, Int8Weight)
    return weight_kind(int8, x_dtype if int8 else w.dtype)


def key(dout: int, din: int, weight_kind: str, rows: int) -> str:
    return f"{dout}x{din}:{weight_kind}:{rows}"


def candidates(weight_kind: str, rows: int) -> list[str]:
    if weight_kind == "int8-float32":
        return list(INT8_FORMS)
    if weight_kind.startswith("int8-"):
        return [f for f in INT8_FORMS if f != "int8_pack_bf16"]       # the same as int8_pack there
    out = ["linear"]
    if rows == 1:
        out.append("mv")
    if rows <= 8:
        out.append("gemv_t")
    if weight_kind in ("bfloat16", "float16"):
        out.append("upcast")
    return out


def default_form(weight_kind: str, rows: int) -> str:
    """What to use before (or without) a measurement: the forms measured on the AVX2 dev machine."""
    if weight_kind.startswith("int8-"):
        return "int8_pack" if rows <= 4 else "int8_dequant"
    if rows == 1:
        return "mv"
    if weight_kind == "bfloat16" and rows >= 8:
        return "upcast"
    if weight_kind == "float32" and rows <= 4:
        return "gemv_t"
    return "linear"


_TABLE: dict[str, str] = {}


def install(table: dict[str, str]) -> None:
    """Make `linear` use these winners (keys from `key`); shapes not in it keep the defaults."""
    unknown = set(table.values()) - set(FORMS)
    if unknown:
        raise ValueError(f"unknown CPU linear forms {sorted(unknown)}; known: {', '.join(FORMS)}")
    _TABLE.update(table)


def pick(x: torch.Tensor, w: Weight) -> Form:
    return pick_rows(x.shape[0], x.dtype, w)


def pick_rows(rows: int, x_dtype: torch.dtype, w: Weight) -> Form:
    """The form for `rows` rows of `x_dtype` times `w` (callers that multiply many weights of one shape and
    kind, such as the experts of a layer, look it up once)."""
    k = kind(w, x_dtype)
    name = _TABLE.get(key(w.shape[0], w.shape[1], k, bucket(rows))) or default_form(k, rows)
    return FORMS[name if rows == 1 or name != "mv" else "gemv_t"]


MARGIN = 0.9   # another form must take at most this share of the default's time to replace it


def race(names: list[str] | tuple[str, ...], default: str, run: Callable[[str, int], object],
         min_seconds: float) -> str:
    """The candidate with the lowest median time per call of `run(name, call_index)`, if it beats `default`
    by a clear margin (a noisy or shared machine must not flip a choice on a few percent). The candidates
    take turns call by call, so a slow patch hits them all alike; `run` may read a different copy of the
    weights per call index, so no candidate finds the weight its predecessor just pulled into the cache."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        run(name, 0)                                               # warm-up (first-call allocations)
    deadline = time.perf_counter() + min_seconds * len(names)
    i, call = 0, 0
    while i < 5 or (time.perf_counter() < deadline and i < 200):
        for name in names:
            t0 = time.perf_counter()
            run(name, call)
            times[name].append(time.perf_counter() - t0)
            call += 1
        i += 1
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    best = min(names, key=median.__getitem__)
    return best if best == default or median[best] <= MARGIN * median[default] else default


def _sample(dout: int, din: int, weight_kind: str, g: torch.Generator) -> tuple[Weight, torch.dtype]:
    """A random weight of this kind and the activation dtype it is multiplied by."""
    w = torch.randn(dout, din, generator=g)                                          # [Dout, Din]
    if weight_kind.startswith("int8-"):
        return quantize_int8(w), getattr(torch, weight_kind.removeprefix("int8-"))
    dtype = getattr(torch, weight_kind)
    return w.to(dtype), dtype


def measure(shapes: Iterable[tuple[int, int, str]], table: MutableMapping[str, str],
            max_rows: int = BUCKETS[-1], stream_bytes: int = 64 * 2**20, min_seconds: float = 0.02) -> list[str]:
    """Time the candidates of every (Dout, Din, kind) at each row bucket up to max_rows, filling `table`
    with the winners. Entries already in `table` are kept (a reused file measures nothing). Returns the
    keys it measured."""
    measured = []
    g = torch.Generator().manual_seed(0)
    for dout, din, weight_kind in dict.fromkeys(shapes):
        todo = [b for b in BUCKETS if b <= bucket(max_rows) and key(dout, din, weight_kind, b) not in table]
        if not todo:
            continue
        first, x_dtype = _sample(dout, din, weight_kind, g)
        itemsize = 1 if isinstance(first, Int8Weight) else first.dtype.itemsize
        copies = max(1, min(64, stream_bytes // max(1, dout * din * itemsize)))
        weights = [first] + [_sample(dout, din, weight_kind, g)[0] for _ in range(copies - 1)]
        for b in todo:
            x = torch.randn(b, din, generator=g).to(x_dtype)                             # [n, Din]
            table[key(dout, din, weight_kind, b)] = race(
                candidates(weight_kind, b), default_form(weight_kind, b),
                lambda name, call, x=x, ws=weights: FORMS[name](x, ws[call % len(ws)]), min_seconds)
            measured.append(key(dout, din, weight_kind, b))
    return measured


def describe(table: dict[str, str]) -> str:
    """One line per shape: which form won at which rows (for the start-up log)."""
    by_shape: dict[str, list[str]] = {}
    for k, form in sorted(table.items(), key=lambda kv: (kv[0].rsplit(":", 1)[0], int(kv[0].rsplit(":", 1)[1]))):
        shape, rows = k.rsplit(":", 1)
        by_shape.setdefault(shape, []).append(f"{rows}:{form}")
    return "; ".join(f"{shape} {' '.join(v)}" for shape, v in by_shape.items())


def valid(entry_key: str, form: str) -> bool:
    """Whether `form` is a candidate for the kind and rows that `entry_key` names (a hand-edited or foreign
    file could pair an int8 weight with a float form)."""
    try:
        shape, weight_kind, rows = entry_key.split(":")
        if "x" not in shape:
            return False
        return form in candidates(weight_kind, int(rows))
    except ValueError:
        return False
