"""Check, measure and install the CPU forms a process will use: the linear forms (`kernels/cpu_forms.py`) for
every weight shape it multiplies by, and the fused-MoE form (`kernels/cpu_moe.py`: per-expert loop or one
grouped GEMM) for every expert shard it holds.

A form must be right before it may be fast. For each (shape, kind) every candidate is first run on the real
shape at several row counts (odd ones too) and compared with a float64 reference (`kernels/form_check.py`);
torch's own kernels that may crash (`FormSpec.isolate`) run that check in a forked child first. A wrong or
crashing form is never timed, never chosen, and never a default for that shape: the table records why as
`reject:<Dout>x<Din>:<kind>:<form>` -> reason, and the log says it once, with the CPU and torch version.
The grouped MoE form must equal the per-expert `linear` form bit for bit, or it is rejected the same way.

A table loaded from the forms file is reused (a key already there is not measured again, its rejects stay);
entries that make no sense for their key are dropped and measured again. `save` runs only when something
was measured.

Shapes: E local experts, I expert width, H hidden size, K experts per token, T tokens of a call; W [Dout, Din].
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable, Iterable, MutableMapping
from dataclasses import dataclass

import torch

from kernels import cpu_forms
from kernels.cpu_forms import BUCKETS, FORMS, Weight, bucket, key
from kernels.cpu_moe import MOE_FORMS, fused_moe_cpu, install_moe, moe_candidates, moe_key
from kernels.form_check import isolated, reference, wrong
from kernels.quant import Int8Weight, quantize_int8

log = logging.getLogger("colibri.kernels")

# What the winners were chosen among (and how): a forms file measured with other candidates or without the
# checks is measured again.
CANDIDATES = "+".join(FORMS) + "/" + "+".join(MOE_FORMS) + "/checked"
REJECT = "reject:"
CHECK_ROWS = (1, 2, 3, 5, 8, 13, 33, 64, 67)     # odd counts too: a kernel's row tails
CHECK_BUDGET = 2**29     # multiply-adds of one form's check: the largest weights (an lm_head) check fewer rows


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


def reject_key(dout: int, din: int, weight_kind: str, form: str) -> str:
    return f"{REJECT}{dout}x{din}:{weight_kind}:{form}"


def _parse_reject(k: str) -> tuple[int, int, str, str] | None:
    """(dout, din, kind, form) of a linear form's reject key, None where it is not one."""
    parts = k.removeprefix(REJECT).split(":")
    parsed = cpu_forms.parse_key(f"{parts[0]}:{parts[1]}:1") if len(parts) == 3 else None
    return None if parsed is None else (parsed[0], parsed[1], parsed[2], parts[2])


def rejected(table: MutableMapping[str, str]) -> set[tuple[int, int, str, str]]:
    """The (dout, din, kind, form) the table's reject entries name."""
    found = (_parse_reject(k) for k in table if k.startswith(REJECT) and not k.startswith(REJECT + "moe:"))
    return {r for r in found if r is not None}


def _machine() -> str:
    """The CPU model (from /proc/cpuinfo), torch and its ATen kernel level, for the one log line of a reject."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, torch {torch.__version__}, ATen {torch.backends.cpu.get_cpu_capability()} kernels"


def _sample(dout: int, din: int, weight_kind: str, g: torch.Generator) -> tuple[Weight, torch.dtype]:
    """A random weight of this kind and the activation dtype it is multiplied by."""
    w = torch.randn(dout, din, generator=g)                                          # [Dout, Din]
    fam = cpu_forms.family(weight_kind)
    if fam != "float":
        return quantize_int8(w, w8a8=fam == "w8a8"), getattr(torch, weight_kind.split("-", 1)[1])
    dtype = getattr(torch, weight_kind)
    return w.to(dtype), dtype


def check_forms(dout: int, din: int, weight_kind: str, names: list[str], max_rows: int, g: torch.Generator,
                table: MutableMapping[str, str]) -> list[str]:
    """The forms among `names` that compute W [dout, din] of this kind right here at every checked row count
    up to max_rows (and one beyond the buckets where calls get more rows; fewer for the largest weights, so
    a check costs at most CHECK_BUDGET multiply-adds a form); the others recorded as rejects."""
    w, x_dtype = _sample(dout, din, weight_kind, g)
    counts, total = [], 0
    for n in CHECK_ROWS:                   # 1, 2, 3, 5 always; more while the budget lasts
        over = (total + n) * dout * din > CHECK_BUDGET
        if n > max(bucket(max_rows), min(max_rows, CHECK_ROWS[-1])) or (n > 5 and over):
            break
        counts.append(n)
        total += n
    xs = [torch.randn(n, din, generator=g).to(x_dtype) for n in counts]              # [n, Din] each
    refs = reference(torch.cat(xs), w).split(counts)                                # float64 [n, Dout] each
    good = []
    for name in names:
        spec = FORMS[name]
        rows = [(x, ref) for x, ref in zip(xs, refs, strict=True) if x.shape[0] <= spec.max_rows]

        def run(spec=spec, rows=rows) -> str | None:
            for x, ref in rows:
                why = wrong(spec.fn(x, w), x, w, ref)
                if why is not None:
                    return f"at {x.shape[0]} rows: {why}"
            return None

        why = isolated(run) if spec.isolate else _guarded(run)
        if why is None:
            good.append(name)
            continue
        table[reject_key(dout, din, weight_kind, name)] = why
        log.warning("the CPU form %s is wrong on this machine for a %s weight [%d, %d] (%s): %s; it is not used "
                    "for that shape", name, weight_kind, dout, din, _machine(), why)
    return good


def _guarded(run: Callable[[], str | None]) -> str | None:
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 (a form that raises on a shape is a wrong form for it)
        return f"raised {type(exc).__name__}: {exc}"


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


def measure(shapes: Iterable[tuple[int, int, str]], table: MutableMapping[str, str],
            max_rows: int = BUCKETS[-1], stream_bytes: int = 64 * 2**20, min_seconds: float = 0.02) -> list[str]:
    """Check, then time the right candidates of every (Dout, Din, kind) at each row bucket up to max_rows,
    filling `table` with the winners and the rejects. Entries already in `table` are kept (a reused file
    measures nothing). Returns the keys it measured."""
    measured = []
    g = torch.Generator().manual_seed(0)
    for dout, din, weight_kind in dict.fromkeys(shapes):
        todo = [b for b in BUCKETS if b <= bucket(max_rows) and key(dout, din, weight_kind, b) not in table]
        if not todo:
            continue
        names = list(dict.fromkeys(n for b in todo for n in cpu_forms.candidates(weight_kind, b, dout, din)))
        names = [n for n in names if reject_key(dout, din, weight_kind, n) not in table]
        good = set(check_forms(dout, din, weight_kind, names, max_rows, g, table))
        cpu_forms.install({}, rejected(table))
        first, x_dtype = _sample(dout, din, weight_kind, g)
        itemsize = 1 if isinstance(first, Int8Weight) else first.dtype.itemsize
        copies = max(1, min(64, stream_bytes // max(1, dout * din * itemsize)))
        weights = [first] + [_sample(dout, din, weight_kind, g)[0] for _ in range(copies - 1)]
        for b in todo:
            here = [n for n in cpu_forms.candidates(weight_kind, b, dout, din) if n in good]
            if not here:
                raise RuntimeError(f"no CPU form computes a {weight_kind} weight [{dout}, {din}] right on this "
                                   f"machine ({_machine()}); see the warnings above")
            default = cpu_forms.default_form(weight_kind, b, dout, din)
            x = torch.randn(b, din, generator=g).to(x_dtype)                             # [n, Din]
            table[key(dout, din, weight_kind, b)] = race(
                here, default if default in here else here[0],
                lambda name, call, x=x, ws=weights: FORMS[name].fn(x, ws[call % len(ws)]), min_seconds)
            measured.append(key(dout, din, weight_kind, b))
    return measured


def _moe_weights(s: MoeShape, g: torch.Generator) -> tuple[object, object, torch.dtype]:
    w13 = torch.randn(s.experts, 2 * s.width, s.hidden, generator=g) * 0.02             # [E, 2I, H]
    w2 = torch.randn(s.experts, s.hidden, s.width, generator=g) * 0.02                  # [E, H, I]
    fam = cpu_forms.family(s.kind)
    if fam != "float":
        x_dtype = getattr(torch, s.kind.split("-", 1)[1])
        return quantize_int8(w13, w8a8=fam == "w8a8"), quantize_int8(w2, w8a8=fam == "w8a8"), x_dtype
    dtype = getattr(torch, s.kind)
    return w13.to(dtype), w2.to(dtype), dtype


def _grouped_is_linear(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
                       weights: torch.Tensor) -> str | None:
    """Why the grouped form's sums differ from the loop's with `linear` for every expert (None: equal)."""
    weight_kind = cpu_forms.kind(w13[0], x.dtype)
    (_, two_i, H), I = w13.shape, w2.shape[2]
    saved = dict(cpu_forms._TABLE)
    cpu_forms._TABLE.update({key(dout, din, weight_kind, b): "linear" for dout, din in ((two_i, H), (H, I))
                             for b in BUCKETS})
    try:
        def sums(form: str) -> torch.Tensor:
            return fused_moe_cpu(x, w13, w2, ids, weights, form=form, acc=torch.zeros(x.shape, dtype=torch.float64))

        want = sums("loop")
        return _guarded(lambda: None if torch.equal(sums("grouped"), want) else
                        "its sums differ from those of the per-expert linear form")
    finally:
        cpu_forms._TABLE.clear()
        cpu_forms._TABLE.update(saved)


def moe_reject_key(s: MoeShape, form: str) -> str:
    return f"{REJECT}{moe_key(s.experts, s.width, s.hidden, s.kind, 0).rsplit(':', 1)[0]}:{form}"


def measure_moe(shapes: Iterable[MoeShape], table: MutableMapping[str, str], max_rows: int = BUCKETS[-1],
                min_seconds: float = 0.02) -> list[str]:
    """Race the MoE forms for each shard shape at each row bucket up to max_rows; fills `table`."""
    measured = []
    g = torch.Generator().manual_seed(0)
    for s in dict.fromkeys(shapes):
        names = list(moe_candidates(s.kind))
        todo = [b for b in BUCKETS if b <= bucket(max_rows)
                and moe_key(s.experts, s.width, s.hidden, s.kind, b) not in table]
        if len(names) < 2 or not todo:
            continue
        w13, w2, x_dtype = _moe_weights(s, g)
        grouped_key = moe_reject_key(s, "grouped")
        if "grouped" in names and grouped_key not in table:
            x = torch.randn(13, s.hidden, generator=g).to(x_dtype)                     # [T, H]
            ids = torch.rand(13, s.experts, generator=g).argsort(dim=1)[:, :s.pairs]
            why = _grouped_is_linear(w13, w2, x, ids, torch.rand(13, s.pairs, generator=g))
            if why is not None:
                table[grouped_key] = why
                log.warning("the grouped CPU MoE form is not used for %s (%s): %s", s, _machine(), why)
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


def _valid(k: str, form: str) -> bool:
    if k.startswith(REJECT + "moe:"):
        return len(k.split(":")) == 5
    if k.startswith(REJECT):
        return _parse_reject(k) is not None
    if k.startswith("moe:"):
        try:
            _, _, weight_kind, rows = k.split(":")
            return form in moe_candidates(weight_kind) and int(rows) in BUCKETS
        except ValueError:
            return False
    return cpu_forms.valid(k, form)


def tune(shapes: Iterable[tuple[int, int, str]], table: MutableMapping[str, str], save: Callable[[], None],
         max_rows: int = BUCKETS[-1], moe: Iterable[MoeShape] = ()) -> list[str]:
    """Check and measure what `table` lacks, `save` if anything was measured, install the winners (and keep
    the rejects out); returns the keys measured now."""
    for k in [k for k, form in table.items() if not _valid(k, form)]:
        del table[k]
    measured = measure(shapes, table, max_rows=max_rows) + measure_moe(moe, table, max_rows=max_rows)
    if measured:
        save()
    install(table)
    return measured


def install(table: MutableMapping[str, str]) -> None:
    """Make the kernels use the table's winners and never its rejects."""
    cpu_forms.install({k: v for k, v in table.items() if not k.startswith(("moe:", REJECT))}, rejected(table))
    install_moe({k: v for k, v in table.items() if k.startswith("moe:")})
