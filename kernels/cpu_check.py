"""Which CPU forms are right on this machine for a weight shape, and how the forms file remembers the others.

For each (shape, kind) every candidate first runs on the real shape at several row counts (odd ones too)
against a float64 reference (`kernels/form_check.py`); torch's own kernels that may crash
(`FormSpec.isolate`) run that check in a forked child first. Then every row bucket a form is timed at is
checked again in this process, at its real thread count, on sampled output columns (`check_bucket`). A form
found wrong or crashing is never timed, chosen or used as a default for that shape: the table records why as
`reject:<Dout>x<Din>:<kind>:<form>` -> reason (lasting verdicts only), the log says it once with the CPU and
torch version, and `install` keeps it out of this process (transient verdicts too).

Shapes: W [Dout, Din]; n rows of x.
"""

from __future__ import annotations

import logging
import platform
from collections.abc import MutableMapping

import torch

from kernels import cpu_forms
from kernels.cpu_forms import BUCKETS, FORMS, Weight, bucket
from kernels.form_check import Verdict, guarded, isolated, reference, wrong
from kernels.formats.int8 import quantize_int8

log = logging.getLogger("colibri.kernels")

REJECT = "reject:"
CHECK_ROWS = (1, 2, 3, 5, 8, 13, 33, 64, 67)     # odd counts too: a kernel's row tails
CHECK_BUDGET = 2**29     # multiply-adds of one form's full check: the largest weights check fewer rows here
SAMPLED_COLS = 256       # output columns a bucket's check compares (every row of the bucket)


def machine_name() -> str:
    """The CPU model (from /proc/cpuinfo), torch and its ATen kernel level, for the one log line of a reject."""
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, torch {torch.__version__}, ATen {torch.backends.cpu.get_cpu_capability()} kernels"


def reject_key(dout: int, din: int, weight_kind: str, form: str) -> str:
    return f"{REJECT}{dout}x{din}:{weight_kind}:{form}"


def parse_reject(k: str) -> tuple[int, int, str, str] | None:
    """(dout, din, kind, form) of a linear form's reject key, None where it is not one."""
    parts = k.removeprefix(REJECT).split(":")
    parsed = cpu_forms.parse_key(f"{parts[0]}:{parts[1]}:1") if len(parts) == 3 and parts[2] in FORMS else None
    return None if parsed is None else (parsed[0], parsed[1], parsed[2], parts[2])


def rejected(table: MutableMapping[str, str]) -> set[tuple[int, int, str, str]]:
    """The (dout, din, kind, form) the table's reject entries name."""
    found = (parse_reject(k) for k in table if k.startswith(REJECT) and not k.startswith(REJECT + "moe:"))
    return {r for r in found if r is not None}


def sample(dout: int, din: int, weight_kind: str, g: torch.Generator) -> tuple[Weight, torch.dtype]:
    """A random weight of this kind and the activation dtype it is multiplied by."""
    w = torch.randn(dout, din, generator=g)                                          # [Dout, Din]
    fam = cpu_forms.family(weight_kind)
    if fam != "float":
        return quantize_int8(w, w8a8=fam == "w8a8"), getattr(torch, weight_kind.split("-", 1)[1])
    dtype = getattr(torch, weight_kind)
    return w.to(dtype), dtype


def refuse(dout: int, din: int, weight_kind: str, name: str, verdict: Verdict, table: MutableMapping[str, str],
           refused: set[tuple[int, int, str, str]]) -> None:
    """Record a refused form: in the table when the verdict lasts, in this process in any case; said once."""
    if verdict.lasting:
        table[reject_key(dout, din, weight_kind, name)] = verdict.why
    refused.add((dout, din, weight_kind, name))
    log.warning("the CPU form %s is %s on this machine for a %s weight [%d, %d] (%s): %s; it is not used for that "
                "shape", name, "wrong" if verdict.lasting else "unusable now", weight_kind, dout, din,
                machine_name(), verdict.why)


def check_forms(dout: int, din: int, weight_kind: str, names: list[str], max_rows: int, g: torch.Generator,
                table: MutableMapping[str, str], refused: set[tuple[int, int, str, str]]) -> list[str]:
    """The forms among `names` that compute W [dout, din] of this kind right here at every checked row count
    up to max_rows (and one beyond the buckets where calls get more rows; fewer for the largest weights, so
    a check costs at most CHECK_BUDGET multiply-adds a form); the others refused."""
    w, x_dtype = sample(dout, din, weight_kind, g)
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

        verdict = isolated(run) if spec.isolate else guarded(run)
        if verdict is None and spec.isolate:
            verdict = guarded(run)                      # then here, with this process's threads
        if verdict is None:
            good.append(name)
        else:
            refuse(dout, din, weight_kind, name, verdict, table, refused)
    return good


def check_bucket(w: Weight, x: torch.Tensor, names: list[str], g: torch.Generator) -> dict[str, Verdict]:
    """The forms among `names` that compute x (a bucket's rows) @ w.T wrong, on sampled output columns."""
    dout = w.shape[0]
    cols = torch.randperm(dout, generator=g)[:SAMPLED_COLS].sort().values if dout > SAMPLED_COLS else None
    ref = reference(x, w if cols is None else w[cols])
    out = {}
    for name in names:
        verdict = guarded(lambda name=name: wrong(FORMS[name].fn(x, w), x, w, ref, cols))
        if verdict is not None:
            out[name] = Verdict(f"at {x.shape[0]} rows: {verdict.why}", verdict.lasting)
    return out


def forms_in_use(weight_kind: str, dout: int, din: int, max_rows: int) -> list[str]:
    """The forms the defaults and batch invariance would run for this weight (checked without --cpu-forms)."""
    used = [cpu_forms.default_form(weight_kind, b, dout, din) for b in BUCKETS if b <= bucket(max_rows)]
    return list(dict.fromkeys([*used, cpu_forms.invariant_form(weight_kind, dout, din)]))
