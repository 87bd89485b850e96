"""Check, measure and install the CPU forms a process will use: the linear forms (`kernels/cpu_forms.py`) for
every weight shape it multiplies by, and the fused-MoE form (`kernels/cpu_moe.py`: per-expert loop or one
grouped GEMM) for every expert shard it holds.

A form must be right before it may be fast (`kernels/cpu_check.py`): only the forms checked right on the real
shape are timed, at every row bucket they are timed at. The grouped MoE form must equal the per-expert
`linear` form bit for bit, or it is rejected the same way. Without a forms file (`--cpu-forms off`) nothing
is timed, but the forms the defaults would run are still checked.

A table loaded from the forms file is reused (a key already there is not measured again, its rejects stay);
entries that make no sense for their key, and winners that a reject names, are dropped and measured again.
`save` runs only when something was measured. Batch invariance is off while measuring: the forms are timed
as they are, each at its row count.

Shapes: E local experts, I expert width, H hidden size, K experts per token, T tokens of a call; W [Dout, Din].
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import TypeVar

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from kernels import cpu_forms, cpu_moe, native
from kernels.cpu_check import (
    REJECT,
    check_bucket,
    check_forms,
    forms_in_use,
    log,
    machine_name,
    parse_reject,
    refuse,
    reject_key,
    rejected,
    sample,
)
from kernels.cpu_forms import BUCKETS, FORMS, bucket, key
from kernels.cpu_moe import (
    MOE_FORMS,
    fused_moe_cpu,
    install_moe,
    moe_candidates,
    moe_key,
    moe_shape_id,
)
from kernels.form_check import guarded, isolated
from kernels.formats.int8 import Int8Weight, quantize_int8
from kernels.reference import fused_moe_reference

# What the winners were chosen among (and how): a forms file measured with other candidates or without the
# checks is measured again.
CANDIDATES = "+".join(FORMS) + "/" + "+".join(MOE_FORMS) + "/checked" + \
    (f"/native@{native.build_id()}" if native.available() else "")
Refused = set[tuple[int, int, str, str]]


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


MARGIN = 0.9   # another form must take at most this share of the default's time to replace it
# ... and of the native form's: besides its own time it lets the router run a decode step's attention block as one
# native call (router_service/model/fusion.py), which a race of the linear alone does not see. From memory at one
# row every form reads at the same rate (qkv [1280, 768] bf16: 92-112 µs each), and 0.9 let noise flip that choice.
NATIVE_MARGIN = 0.8


def race(names: list[str] | tuple[str, ...], default: str, run: Callable[[str, int], object],
         min_seconds: float, margin: float = MARGIN) -> str:
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
    return best if best == default or median[best] <= margin * median[default] else default


def measure(shapes: Iterable[tuple[int, int, str]], table: MutableMapping[str, str],
            max_rows: int = BUCKETS[-1], stream_bytes: int = 64 * 2**20, min_seconds: float = 0.02,
            refused: Refused | None = None, timed: bool = True) -> list[str]:
    """Check, then time the right candidates of every (Dout, Din, kind) at each row bucket up to max_rows,
    filling `table` with the winners and the rejects (`refused` gathers this process's refusals, lasting or
    not). Entries already in `table` are kept (a reused file measures nothing). `timed=False` checks only
    the forms the defaults would run. Returns the keys it measured."""
    measured: list[str] = []
    refused = set() if refused is None else refused
    g = torch.Generator().manual_seed(0)
    work = [(shape, [b for b in BUCKETS if b <= bucket(max_rows) and key(*shape, b) not in table])
            for shape in dict.fromkeys(shapes)]
    work = [(shape, todo) for shape, todo in work if todo]
    for (dout, din, weight_kind), todo in _progress(work, timed):
        names = forms_in_use(weight_kind, dout, din, max_rows) if not timed else list(dict.fromkeys(
            n for b in todo for n in cpu_forms.candidates(weight_kind, b, dout, din)))
        names = [n for n in names if reject_key(dout, din, weight_kind, n) not in table]
        good = set(check_forms(dout, din, weight_kind, names, max_rows, g, table, refused))
        cpu_forms.install({}, refused | rejected(table))
        if not timed:
            continue
        first, x_dtype = sample(dout, din, weight_kind, g)
        xs = {b: torch.randn(b, din, generator=g).to(x_dtype) for b in todo}        # [n, Din] per bucket
        for b in todo:                                      # every bucket a form is timed at, checked first
            for name, verdict in check_bucket(first, xs[b], [n for n in good if n in cpu_forms.candidates(
                    weight_kind, b, dout, din)], g).items():
                refuse(dout, din, weight_kind, name, verdict, table, refused)
                good.discard(name)
        cpu_forms.install({}, refused | rejected(table))
        itemsize = 1 if isinstance(first, Int8Weight) else first.dtype.itemsize
        copies = max(1, min(64, stream_bytes // max(1, dout * din * itemsize)))
        weights = [first] + [sample(dout, din, weight_kind, g)[0] for _ in range(copies - 1)]
        for b in todo:
            here = [n for n in cpu_forms.candidates(weight_kind, b, dout, din) if n in good]
            if not here:                                    # correct before fast: exact, slow, and said so
                log.error("no CPU form computes a %s weight [%d, %d] right at %d rows on this machine (%s); it is "
                          "computed in float64 there (slow: see the warnings above)", weight_kind, dout, din, b,
                          machine_name())
                table[key(dout, din, weight_kind, b)] = cpu_forms.LAST_RESORT
                measured.append(key(dout, din, weight_kind, b))
                continue
            default = cpu_forms.default_form(weight_kind, b, dout, din)
            table[key(dout, din, weight_kind, b)] = race(
                here, default if default in here else here[0],
                lambda name, call, x=xs[b], ws=weights: FORMS[name].fn(x, ws[call % len(ws)]), min_seconds,
                NATIVE_MARGIN if default in (*cpu_forms.NATIVE_OF.values(), cpu_forms.TILES) else MARGIN)
            measured.append(key(dout, din, weight_kind, b))
    return measured


Work = TypeVar("Work")


def _progress(work: list[Work], timed: bool) -> Iterator[Work]:
    """`work` with a bar where stderr is a terminal (tqdm's disable=None), as a shape takes seconds to measure; the
    log's lines meanwhile go above it, not through it."""
    bar = tqdm(work, desc="measuring CPU forms", unit="shape", disable=None if timed and work else True)
    with contextlib.nullcontext() if bar.disable else logging_redirect_tqdm():      # the handlers swapped only
        yield from bar                                                               # while a bar shows


def _moe_weights(s: MoeShape, g: torch.Generator, experts: int = 0) -> tuple[object, object, torch.dtype]:
    """Random weights of the shape (of `experts` of its experts where given), and the activations' dtype."""
    E = experts or s.experts
    w13 = torch.randn(E, 2 * s.width, s.hidden, generator=g) * 0.02                     # [E, 2I, H]
    w2 = torch.randn(E, s.hidden, s.width, generator=g) * 0.02                          # [E, H, I]
    fam = cpu_forms.family(s.kind)
    if fam != "float":
        x_dtype = getattr(torch, s.kind.split("-", 1)[1])
        return quantize_int8(w13, w8a8=fam == "w8a8"), quantize_int8(w2, w8a8=fam == "w8a8"), x_dtype
    dtype = getattr(torch, s.kind)
    return w13.to(dtype), w2.to(dtype), dtype


def _grouped_is_linear(s: MoeShape, w13: torch.Tensor, w2: torch.Tensor, x_dtype: torch.dtype,
                       g: torch.Generator) -> str | None:
    """Why the grouped form's sums differ from the loop's with `linear` for every expert (None: equal), at a
    few rows per expert and at many."""
    everywhere_linear = {key(dout, din, s.kind, b): "linear" for dout, din in ((2 * s.width, s.hidden),
                                                                             (s.hidden, s.width)) for b in BUCKETS}
    with cpu_forms.installed(everywhere_linear):
        for tokens in (13, 100):
            x = torch.randn(tokens, s.hidden, generator=g).to(x_dtype)                     # [T, H]
            ids = torch.rand(tokens, s.experts, generator=g).argsort(dim=1)[:, :s.pairs]   # [T, K]
            weights = torch.rand(tokens, s.pairs, generator=g)                             # [T, K]

            def sums(form: str, x=x, ids=ids, weights=weights) -> torch.Tensor:
                return fused_moe_cpu(x, w13, w2, ids, weights, form=form,
                                     acc=torch.zeros(x.shape, dtype=torch.float64))

            want = sums("loop")
            verdict = guarded(lambda sums=sums, want=want: None if torch.equal(sums("grouped"), want) else
                              "its sums differ from those of the per-expert linear form")
            if verdict is not None:
                return f"at {tokens} tokens: {verdict.why}"
    return None


def moe_reject_key(s: MoeShape, form: str) -> str:
    return f"{REJECT}{moe_key(s.experts, s.width, s.hidden, s.kind, 0).rsplit(':', 1)[0]}:{form}"


CHECKED = "checked:"        # a check passed, recorded in the table (not a form that won a race)


def moe_checked_key(s: MoeShape) -> str:
    """Where the table records that the native expert FFN passed its check for this shape (with a forms file, a
    later start skips it: the check takes ≈0.4 s, serialised over a fleet's processes by the file's lock)."""
    return f"{CHECKED}{moe_key(s.experts, s.width, s.hidden, s.kind, 0).rsplit(':', 1)[0]}"


def check_native_moe(shapes: Iterable[MoeShape], table: MutableMapping[str, str], refused: set[str]) -> list[str]:
    """The native expert FFN of each shard shape against the float64 reference at 1, 5 and 33 tokens, in a
    forked child first: where it is wrong it is rejected (the torch forms serve that shape), where right the pass
    is recorded. It runs on a few experts of the shape's size (the kernel treats every expert alike): a shard's
    worth of random weights would make the check the largest allocation of a worker with a bounded expert cache.
    Returns the keys it added."""
    g = torch.Generator().manual_seed(1)
    added = []
    for s in dict.fromkeys(shapes):
        rkey, ckey = moe_reject_key(s, "native"), moe_checked_key(s)
        if not (native.available() and s.kind in native.KINDS) or rkey in table or ckey in table:
            continue
        experts = min(s.experts, s.pairs + 3)
        w13, w2, x_dtype = _moe_weights(s, g, experts)
        ref13, ref2 = (w.dequantize(torch.float64) if isinstance(w, Int8Weight) else w for w in (w13, w2))
        cases = []
        for tokens in (1, 5, 33):
            x = torch.randn(tokens, s.hidden, generator=g).to(x_dtype)                     # [T, H]
            ids = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :s.pairs]     # [T, K]
            weights = torch.rand(tokens, s.pairs, generator=g)                             # [T, K]
            cases.append((x, ids, weights, fused_moe_reference(x, ref13, ref2, ids, weights)))

        tolerance = W8A8_TOLERANCE if s.kind.startswith("w8a8-") else None

        def run(cases=cases, w13=w13, w2=w2, tolerance=tolerance) -> str | None:
            for x, ids, weights, ref in cases:
                got = fused_moe_cpu(x, w13, w2, ids, weights, form="native", acc=torch.zeros(x.shape,
                                                                                            dtype=torch.float64))
                err = float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-300))
                if not err <= (tolerance or MOE_TOLERANCE.get(x.dtype, 1e-2)):
                    return f"at {x.shape[0]} tokens it is off by {err:.3g} of the largest output against float64"
            return None

        verdict = isolated(run) or guarded(run)
        if verdict is None:
            table[ckey] = "native"
            added.append(ckey)
            continue
        if verdict.lasting:
            table[rkey] = verdict.why
            added.append(rkey)
        refused.add(moe_shape_id(s.experts, s.width, s.hidden, s.kind))
        log.warning("the native expert FFN is not used for %s (%s): %s", s, machine_name(), verdict.why)
    return added


MOE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}    # the kernel tests' bounds (two GEMMs, float32)
W8A8_TOLERANCE = 3e-2     # W8A8 quantises the activations too (twice per expert), against unquantised float64


def measure_moe(shapes: Iterable[MoeShape], table: MutableMapping[str, str], max_rows: int = BUCKETS[-1],
                min_seconds: float = 0.02, refused: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Race the MoE forms for each shard shape at each row bucket up to max_rows, where the native expert FFN
    does not serve it (not built, another kind, or `refused`/rejected here); fills `table`."""
    measured = []
    g = torch.Generator().manual_seed(0)
    for s in dict.fromkeys(shapes):
        if cpu_moe.native_serves(s.experts, s.width, s.hidden, s.kind) and moe_reject_key(s, "native") not in table \
                and moe_shape_id(s.experts, s.width, s.hidden, s.kind) not in refused:
            continue                                    # the native expert FFN serves it: nothing to race
        names = list(moe_candidates(s.kind))
        todo = [b for b in BUCKETS if b <= bucket(max_rows)
                and moe_key(s.experts, s.width, s.hidden, s.kind, b) not in table]
        if len(names) < 2 or not todo:
            continue
        w13, w2, x_dtype = _moe_weights(s, g)
        grouped_key = moe_reject_key(s, "grouped")
        if grouped_key not in table:
            why = _grouped_is_linear(s, w13, w2, x_dtype, g)
            if why is not None:
                table[grouped_key] = why
                log.warning("the grouped CPU MoE form is not used for %s (%s): %s", s, machine_name(), why)
        if grouped_key in table:
            names.remove("grouped")
        for b in todo:
            x = torch.randn(b, s.hidden, generator=g).to(x_dtype)                          # [T, H]
            ids = torch.rand(b, s.experts, generator=g).argsort(dim=1)[:, :s.pairs]          # [T, K] distinct
            weights = torch.rand(b, s.pairs, generator=g)                                   # [T, K]
            k = moe_key(s.experts, s.width, s.hidden, s.kind, b)
            table[k] = race(
                names, "loop", lambda name, call, x=x, ids=ids, weights=weights, w13=w13, w2=w2: fused_moe_cpu(
                    x, w13, w2, ids, weights, form=name), min_seconds) if len(names) > 1 else "loop"
            measured.append(k)
    return measured


def _valid(k: str, form: str, rejects: Refused) -> bool:
    if k.startswith(CHECKED):
        return k.startswith(CHECKED + "moe:") and form == "native" and len(k.split(":")) == 4
    if k.startswith(REJECT + "moe:"):
        return len(k.split(":")) == 5
    if k.startswith(REJECT):
        return parse_reject(k) is not None
    if k.startswith("moe:"):
        try:
            _, _, weight_kind, rows = k.split(":")
            return form in moe_candidates(weight_kind) and int(rows) in BUCKETS
        except ValueError:
            return False
    parsed = cpu_forms.parse_key(k)
    return cpu_forms.valid(k, form) and parsed is not None and (*parsed[:3], form) not in rejects


def tune(shapes: Iterable[tuple[int, int, str]], table: MutableMapping[str, str], save: Callable[[], None],
         max_rows: int = BUCKETS[-1], moe: Iterable[MoeShape] = (), timed: bool = True) -> list[str]:
    """Check and measure what `table` lacks, `save` if anything was measured, install the winners (and keep
    the refused forms out); returns the keys measured now. `timed=False` (no forms file): check the forms
    the defaults would run, measure nothing."""
    rejects = rejected(table)
    for k in [k for k, form in table.items() if not _valid(k, form, rejects)]:
        del table[k]
    invariant = cpu_forms.batch_invariant()
    cpu_forms.set_batch_invariant(False)                 # forms are checked and timed as they are
    refused: Refused = set()
    moe_refused: set[str] = set()
    try:
        measured = measure(shapes, table, max_rows=max_rows, refused=refused, timed=timed)
        checked = check_native_moe(moe, table, moe_refused)
        measured += measure_moe(moe, table, max_rows=max_rows, refused=moe_refused) if timed else []
    finally:
        cpu_forms.set_batch_invariant(invariant)
    if measured or checked:
        save()
    install(table, refused, moe_refused)
    return measured


def install(table: MutableMapping[str, str], refused: Refused = frozenset(), moe_refused: set[str] = frozenset()
            ) -> None:
    """Make the kernels use the table's winners and never its rejects (nor this process's refusals)."""
    cpu_forms.install({k: v for k, v in table.items() if not k.startswith(("moe:", REJECT, CHECKED))},
                      set(refused) | rejected(table))
    native_rejected = {k.removeprefix(REJECT + "moe:").rsplit(":", 1)[0] for k in table
                       if k.startswith(REJECT + "moe:") and k.endswith(":native")}
    install_moe({k: v for k, v in table.items() if k.startswith("moe:")}, native_rejected | set(moe_refused))
