"""The forms of y = x @ W.T on a CPU, which one a call uses, and what each may be trusted with.

CPUs disagree: on an AVX2-only EPYC bf16 arithmetic is emulated and an upcast to float32 wins from ≈8 rows,
on a Xeon with AMX / AVX512-BF16 oneDNN's bf16 GEMM wins at every row count. So nothing is hard-coded:
`kernels/cpu_tune.py` checks every candidate against a float64 reference on the model's real shapes, then
times the right ones at row buckets 1, 2, 4, ... 64, and `install` makes `pick_rows` use the winners.

Three rules keep a form from changing what the user asked for:
- **No form lowers precision.** Float activations stay in their dtype (an upcast computes more precisely, never
  less); weight-only int8 (`int8-*`) multiplies the activations as they are; only the explicit W8A8 kind
  (`w8a8-*`, `--quantize w8a8`) quantises activations, and every W8A8 form computes the same int8 products.
- **Guards for the shapes a kernel cannot take.** torch's `_weight_int8pack_mm` loads 16 (AVX-512) or 8 (AVX2)
  values of a row with aligned loads: with an input width that is not a multiple of 16 it reads past the row
  (garbage, or SIGSEGV at the buffer's end; aten/src/ATen/native/cpu/int8mm_kernel.cpp), so it is no candidate
  there, and its inputs are aligned as those loads need (32 bytes for the activations, 16 for the weight).
- **Batch invariance** (`set_batch_invariant`): one form per weight for every row count, a single-row form run
  row by row, so a row's result never depends on the other rows of its batch.

A weight's *kind* names what the forms see: its dtype ("float32", "bfloat16"), "int8-<activation dtype>" for
a weight-only `Int8Weight`, or "w8a8-<activation dtype>" for one that quantises its activations too.

Shapes: n rows of x, Din input features, Dout output features; W [Dout, Din].
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import native
from kernels.form_check import reference
from kernels.formats.int8 import Int8Weight, quantize_rows

Weight = torch.Tensor | Int8Weight
Form = Callable[[torch.Tensor, Weight], torch.Tensor]            # (x [n, Din], W [Dout, Din]) -> [n, Dout]


def _aligned(t: torch.Tensor, to: int = 64) -> torch.Tensor:
    """`t` contiguous at a `to`-byte aligned address (a copy only where it is not)."""
    return t if t.is_contiguous() and t.data_ptr() % to == 0 else t.clone(memory_format=torch.contiguous_format)


def _mv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mv(w, x[0])[None]                                # one row: a streaming matrix-vector


def _gemv_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(w, x.t()).t()                                 # W @ x.T keeps W streaming, no packing


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)                                         # oneDNN / MKL GEMM in W's dtype


def _upcast(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), w.float()).to(x.dtype)             # float32 GEMM on a converted copy of W


def _int8_pack(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """int8 weights, activations as they are (bf16: AVX2/AVX-512 code; float32: torch's scalar loop)."""
    return torch._weight_int8pack_mm(_aligned(x, 32), _aligned(w.q, 16), w.scale.to(x.dtype))   # its loads


def _int8_dequant(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    return (F.linear(x.float(), w.q.float()) * w.scale).to(x.dtype)   # float32 GEMM on a converted copy


def _w8a8_intmm(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    xq, xs = quantize_rows(x)                                     # [n, Din] int8, [n] per-row scales
    acc = torch._int_mm(xq, w.q.t())                              # [n, Dout] int32, exact
    return (acc.float() * xs[:, None] * w.scale).to(x.dtype)


def _w8a8_dequant(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """The same int8 products in a float32 GEMM (exact while a row's sum stays below 2^24)."""
    xq, xs = quantize_rows(x)
    return (F.linear(xq.float(), w.q.float()) * xs[:, None] * w.scale).to(x.dtype)


def _float64(x: torch.Tensor, w: Weight) -> torch.Tensor:
    """The float64 product of what is held, cast: the last resort where every other form was found wrong."""
    return reference(x, w).product.to(x.dtype)


@dataclass(frozen=True)
class FormSpec:
    """One form: which kinds it computes (its family, and within it only `kinds` where given), up to how many rows
    it is worth racing, whether it is a compiled kernel that may crash on some CPU (first run in a forked child:
    kernels/form_check.py), the shapes it cannot take (`fits(dout, din)`), and whether each row's result is
    independent of the others by construction (batch invariance needs no row-by-row loop then)."""

    fn: Form
    family: str                                  # "float", "int8" (weight-only) or "w8a8"
    max_rows: int = 1 << 30
    isolate: bool = False
    fits: Callable[[int, int], bool] = lambda dout, din: True
    kinds: tuple[str, ...] = ()
    invariant: bool = False


def _int8pack_fits(dout: int, din: int) -> bool:
    return din % 16 == 0                         # the AVX-512 kernel's 16-wide aligned loads of each row


FORMS: dict[str, FormSpec] = {
    "mv": FormSpec(_mv, "float", max_rows=1),
    "gemv_t": FormSpec(_gemv_t, "float", max_rows=8),
    "linear": FormSpec(_linear, "float"),
    "upcast": FormSpec(_upcast, "float"),
    "int8_pack": FormSpec(_int8_pack, "int8", isolate=True, fits=_int8pack_fits),
    "int8_dequant": FormSpec(_int8_dequant, "int8"),
    "w8a8_intmm": FormSpec(_w8a8_intmm, "w8a8", isolate=True),
    "w8a8_dequant": FormSpec(_w8a8_dequant, "w8a8"),
}
if native.available():                       # Colibri's own kernels (kernels/native/), where make setup built them
    FORMS["native"] = FormSpec(native.linear, "float", isolate=True, kinds=("float32", "bfloat16"), invariant=True)
    FORMS["native_int8"] = FormSpec(native.linear, "int8", isolate=True, kinds=("int8-float32", "int8-bfloat16"),
                                    invariant=True)
if native.int8_tiles():                      # AMX: int8 widened to bf16 per block, on tiles (bf16 x only)
    FORMS["native_int8_tiles"] = FormSpec(native.linear_int8_tiles, "int8", isolate=True, kinds=("int8-bfloat16",),
                                          invariant=True)
LAST_RESORT = "float64"     # never raced: used only where no candidate of a shape and row count is right
NATIVE_OF = {"float": "native", "int8": "native_int8"}     # the native form of a family: the default where built
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def bucket(n: int) -> int:
    """The row bucket of n rows: the next power of two, at most the largest bucket."""
    b = 1
    while b < n and b < BUCKETS[-1]:
        b *= 2
    return b


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weight_kind(quantize: str | None, dtype: torch.dtype) -> str:
    """The kind of a weight held in `dtype` (quantize None), or as int8 ("int8": weight-only; "w8a8": int8
    activations too) multiplied by `dtype` activations."""
    return f"{quantize}-{dtype_name(dtype)}" if quantize else dtype_name(dtype)


def kind(w: Weight, x_dtype: torch.dtype) -> str:
    if isinstance(w, Int8Weight):
        return weight_kind("w8a8" if w.w8a8 else "int8", w.act_dtype or x_dtype)
    return dtype_name(w.dtype)


def family(weight_kind_: str) -> str:
    return weight_kind_.split("-")[0] if "-" in weight_kind_ else "float"


def key(dout: int, din: int, weight_kind_: str, rows: int) -> str:
    return f"{dout}x{din}:{weight_kind_}:{rows}"


def candidates(weight_kind_: str, rows: int, dout: int = 0, din: int = 0) -> list[str]:
    """The forms raced for this kind at this row bucket on W [dout, din] (0, 0: any shape a form takes)."""
    fam = family(weight_kind_)
    out = [name for name, f in FORMS.items() if f.family == fam and rows <= f.max_rows
           and (not dout or f.fits(dout, din)) and (not f.kinds or weight_kind_ in f.kinds)]
    if fam == "float" and weight_kind_ == "float32":
        out = [n for n in out if n != "upcast"]                       # already float32: the same as linear
    return out


_REJECTED: set[tuple[int, int, str, str]] = set()      # (dout, din, kind, form) found wrong or crashing here


def usable(name: str, dout: int, din: int, weight_kind_: str) -> bool:
    f = FORMS.get(name)
    return f is not None and f.family == family(weight_kind_) and f.fits(dout, din) and \
        (not f.kinds or weight_kind_ in f.kinds) and (dout, din, weight_kind_, name) not in _REJECTED


TILES = "native_int8_tiles"


def usable_or_candidate(name: str, weight_kind_: str, rows: int, dout: int, din: int) -> bool:
    """Whether form `name` may serve this weight (a shape given) or this kind and row count (dout 0)."""
    return usable(name, dout, din, weight_kind_) if dout else name in candidates(weight_kind_, rows)


def default_form(weight_kind_: str, rows: int, dout: int = 0, din: int = 0) -> str:
    """What to use before (or without) a measurement: the native kernel where it takes the kind (weight-only int8
    against bf16 x from 3 rows: on tiles where the level has them), else the torch forms measured on the AVX2 dev
    machine, where this shape may take them and this machine did not reject them; else the plain torch GEMM of
    the family."""
    fam = family(weight_kind_)
    mine = NATIVE_OF.get(fam)
    if rows > 2 and usable_or_candidate(TILES, weight_kind_, rows, dout, din):
        return TILES            # from 3 rows on the tiles outran the float path on every dense shape measured
    if mine is not None and usable_or_candidate(mine, weight_kind_, rows, dout, din):
        return mine
    if fam == "int8":
        want = "int8_pack" if rows <= 4 else "int8_dequant"
    elif fam == "w8a8":
        want = "w8a8_intmm"
    elif rows == 1:
        want = "mv"
    elif weight_kind_ == "bfloat16" and rows >= 8:
        want = "upcast"
    elif weight_kind_ == "float32" and rows <= 4:
        want = "gemv_t"
    else:
        want = "linear"
    if not dout or usable(want, dout, din, weight_kind_):
        return want
    plain = {"int8": "int8_dequant", "w8a8": "w8a8_dequant"}.get(fam, "linear")
    return plain if usable(plain, dout, din, weight_kind_) else LAST_RESORT


def invariant_form(weight_kind_: str, dout: int, din: int) -> str:
    """The one form a weight uses at every row count under batch invariance, run one row at a time: chosen by
    rule, not by timing, so every process of a fleet computes a given row alike."""
    fam = family(weight_kind_)
    order = {"int8": ("native_int8", "int8_pack", "int8_dequant"),
             "w8a8": ("w8a8_intmm", "w8a8_dequant")}.get(fam, ("native", "mv", "linear"))
    return next((n for n in order if usable(n, dout, din, weight_kind_)), LAST_RESORT)


_TABLE: dict[str, str] = {}
_INVARIANT = False


def install(table: dict[str, str], rejected: set[tuple[int, int, str, str]] | None = None) -> None:
    """Make `pick_rows` use these winners (keys from `key`) and never the `rejected` forms (a winner they name is
    dropped: that shape and row count takes its default); shapes not in the table keep the defaults."""
    unknown = set(table.values()) - set(FORMS) - {LAST_RESORT}
    if unknown:
        raise ValueError(f"unknown CPU linear forms {sorted(unknown)}; known: {', '.join(FORMS)}")
    _REJECTED.update(rejected or ())
    _TABLE.update(table)
    for k, form in list(_TABLE.items()):
        parsed = parse_key(k)
        if parsed is not None and (*parsed[:3], form) in _REJECTED:
            del _TABLE[k]


@contextlib.contextmanager
def installed(table: dict[str, str]) -> Iterator[None]:
    """These winners for the duration (a measurement's own comparisons), then the table as it was."""
    saved = dict(_TABLE)
    _TABLE.update(table)
    try:
        yield
    finally:
        _TABLE.clear()
        _TABLE.update(saved)


def set_batch_invariant(on: bool) -> None:
    """Batch invariance for this process: every linear runs its weight's `invariant_form` row by row."""
    global _INVARIANT
    _INVARIANT = on


def batch_invariant() -> bool:
    return _INVARIANT


def _rowwise(form: Form) -> Form:
    def run(x: torch.Tensor, w: Weight) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.empty(0, w.shape[0], dtype=x.dtype, device=x.device)
        if x.shape[0] == 1:
            return form(_aligned(x), w)
        return torch.cat([form(_aligned(x[i:i + 1]), w) for i in range(x.shape[0])])   # [n, Dout]

    return run


def pick(x: torch.Tensor, w: Weight) -> Form:
    return pick_rows(x.shape[0], x.dtype, w)


def pick_rows(rows: int, x_dtype: torch.dtype, w: Weight) -> Form:
    """The form for `rows` rows of `x_dtype` times `w` (callers that multiply many weights of one shape and
    kind, such as the experts of a layer, look it up once)."""
    k = kind(w, x_dtype)
    name = form_name(rows, k, w.shape[0], w.shape[1])
    if _INVARIANT:
        return _fn(name) if name in FORMS and FORMS[name].invariant else _rowwise(_fn(name))
    return _fn(name)


def form_name(rows: int, weight_kind_: str, dout: int, din: int) -> str:
    """The name of the form `pick_rows` runs for `rows` rows against a weight of this kind and shape."""
    if _INVARIANT:
        return invariant_form(weight_kind_, dout, din)
    name = _TABLE.get(key(dout, din, weight_kind_, bucket(rows))) or default_form(weight_kind_, rows, dout, din)
    return name if rows == 1 or name != "mv" else "gemv_t"


def in_force(shapes: list[tuple[int, int, str]], max_rows: int) -> str:
    """For the start-up log: the form each weight shape runs at each row bucket's own row count up to max_rows, in
    this process (the measured winners, less what was refused here, else the defaults, which at rows between two
    buckets may differ; under batch invariance one form for all, run a row at a time)."""
    return describe({key(dout, din, k, b): form_name(b, k, dout, din)
                     for dout, din, k in dict.fromkeys(shapes) for b in BUCKETS if b <= bucket(max_rows)})


def _fn(name: str) -> Form:
    return _float64 if name == LAST_RESORT else FORMS[name].fn


def describe(table: dict[str, str]) -> str:
    """One line per shape: which form won at which rows (for the start-up log)."""
    by_shape: dict[str, list[str]] = {}
    for k, form in sorted(table.items(), key=lambda kv: (kv[0].rsplit(":", 1)[0], int(kv[0].rsplit(":", 1)[1]))):
        shape, rows = k.rsplit(":", 1)
        by_shape.setdefault(shape, []).append(f"{rows}:{form}")
    return "; ".join(f"{shape} {' '.join(v)}" for shape, v in by_shape.items())


def parse_key(entry_key: str) -> tuple[int, int, str, int] | None:
    """(dout, din, kind, rows) of a table key, None where it is not one."""
    try:
        shape, weight_kind_, rows = entry_key.split(":")
        dout, din = (int(v) for v in shape.split("x"))
        return dout, din, weight_kind_, int(rows)
    except ValueError:
        return None


def valid(entry_key: str, form: str) -> bool:
    """Whether `form` is a candidate for the shape, kind and rows that `entry_key` names (a hand-edited or
    foreign file could pair an int8 weight with a float form, or a guarded form with a shape it cannot take),
    or the last resort."""
    parsed = parse_key(entry_key)
    if parsed is None or parsed[3] not in BUCKETS:
        return False
    dout, din, weight_kind_, rows = parsed
    return form == LAST_RESORT or form in candidates(weight_kind_, rows, dout, din)
