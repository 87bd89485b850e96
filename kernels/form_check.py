"""A form must be right before it may be fast: one form's product against a float64 reference, and torch's own
kernels that may crash on some CPU first run in a forked child.

`wrong(y, x, w)` compares one form's product with the float64 product of what is held (the dequantised int8
weight; for W8A8 the per-row int8 activations too). A correct form differs by its output's rounding
(relative to the result) and its float32 accumulation (relative to the sums of the terms' magnitudes,
|x| @ |W|.T, which a result that cancels to almost nothing does not show); a wrong one (garbage from reads
past a row, a wrong layout, NaN) by about the result itself. The check is per row, so one bad row cannot hide
among good ones.

`isolated(run)` runs `run()` in a forked child with one torch thread (an OpenMP pool does not survive fork)
and reports a crash (the signal), a hang (the timeout; the child's own alarm ends it even if the parent
dies) or the child's own verdict, so a kernel that takes a process down on this CPU takes down only the
probe. A verdict says whether it is lasting (a wrong result, a crash: facts about this CPU and torch, kept
in the forms file) or may be the load of the moment (a hang, an exception, a failed fork: this process
only).

Shapes: n rows of x, Din input features, Dout output features; W [Dout, Din].
"""

from __future__ import annotations

import faulthandler
import logging
import os
import select
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.formats.int8 import Int8Weight, quantize_rows

log = logging.getLogger("colibri.kernels")

# Largest per-row error ||y - ref|| / ||ref|| a correct form shows, by output dtype: the output's rounding
# (2^-9 for bf16, 2^-12 for fp16, 2^-24 for fp32) and float32 accumulation, with a margin (the correct bf16
# forms measured <= 2.4e-3). Rounding float32 activations to bf16 shows ~2^-9 and fails the float32 bound;
# quantising bf16 activations to int8 shows ~9e-3 and fails the bf16 one.
TOLERANCE = {torch.float32: 2.0**-14, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-7}
ACCUMULATION = 2.0**-16   # float32 sums: error over ||(|x| @ |W|.T) row|| (typically sqrt(Din) 2^-24)


@dataclass(frozen=True)
class Verdict:
    """Why a form was refused; `lasting`: a fact about this CPU and torch (kept in the forms file)."""

    why: str
    lasting: bool = True


@dataclass(frozen=True)
class Expected:
    """What a form must compute for x @ w.T: the float64 product [n, Dout] and |x| @ |W|.T, the scale of its
    accumulation error [n, Dout]."""

    product: torch.Tensor
    magnitude: torch.Tensor

    def split(self, counts: list[int]) -> list[Expected]:
        return [Expected(p, m) for p, m in zip(self.product.split(counts), self.magnitude.split(counts),
                                               strict=True)]


def reference(x: torch.Tensor, w: torch.Tensor | Int8Weight) -> Expected:
    """The float64 product a form of this kind must compute: x [n, Din], w [Dout, Din] -> [n, Dout]."""
    if not isinstance(w, Int8Weight):
        xd, wd = x.double(), w.double()                                      # [n, Din], [Dout, Din]
        return Expected(xd @ wd.t(), xd.abs() @ wd.abs().t())
    wd = w.q.double()                                                        # [Dout, Din]
    if w.w8a8:
        xq, xs = quantize_rows(x)
        xd, scale = xq.double(), xs.double()[:, None] * w.scale.double()     # [n, Din], [n, Dout]
        return Expected((xd @ wd.t()) * scale, (xd.abs() @ wd.abs().t()) * scale.abs())
    xd, wd = x.double(), wd * w.scale.double()[:, None]
    return Expected(xd @ wd.t(), xd.abs() @ wd.abs().t())


def wrong(y: object, x: torch.Tensor, w: torch.Tensor | Int8Weight, ref: Expected | None = None,
          cols: torch.Tensor | None = None) -> str | None:
    """Why `y`, a form's result for x @ w.T, is wrong; None when it is right (`ref`: `reference(x, w)`, when the
    caller checks several forms on one input; `cols`: compare only these output columns, `ref` being
    `reference(x, w[cols])`, so the largest weights are checked at every row count for little)."""
    n, dout = x.shape[0], w.shape[0]
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != (n, dout) or y.dtype != x.dtype:
        got = f"{y.dtype} {list(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
        return f"returned {got}, not {x.dtype} [{n}, {dout}]"
    yd = y.double() if cols is None else y[:, cols].double()
    if not bool(torch.isfinite(yd).all()):
        return "returned non-finite values"
    if ref is None:
        ref = reference(x, w if cols is None else w[cols])
    allowed = TOLERANCE.get(x.dtype, 2.0**-7) * ref.product.norm(dim=1) + ACCUMULATION * ref.magnitude.norm(dim=1)
    err = (yd - ref.product).norm(dim=1) / allowed.clamp(min=1e-300)        # [n] per row, 1 = the bound
    worst = int(err.argmax())
    if float(err[worst]) > 1:
        rel = float((yd - ref.product)[worst].norm() / ref.product[worst].norm().clamp(min=1e-300))
        return (f"row {worst} of {n} is off by {rel:.3g} of its norm against float64, {float(err[worst]):.3g}x "
                f"what a right form may be (max error {float((yd - ref.product).abs().max()):.3g})")
    return None


def guarded(run: Callable[[], str | None]) -> Verdict | None:
    """`run()` in this process: its verdict, or a passing one (not lasting) if it raises."""
    try:
        why = run()
    except Exception as exc:  # noqa: BLE001 (a form that raises on a shape is refused for it)
        return Verdict(f"raised {type(exc).__name__}: {exc}", lasting=False)
    return None if why is None else Verdict(why)


def isolated(run: Callable[[], str | None], timeout: float = 60.0) -> Verdict | None:
    """Run `run()` (None = right, else why it is wrong) in a forked child; what went wrong, or None. A crash counts
    only where a second child crashes too: both children run the same inputs in a copy of the same memory, so a
    kernel that reads out of bounds or executes what this CPU lacks crashes both times, while a crash the second
    child does not repeat came from the probe's moment, not the form (a CI run once saw the native expert FFN's probe
    die of SIGSEGV in one worker of three, and the verdict, kept in the forms file, turned every worker away from
    it)."""
    verdict = _in_child(run, timeout)
    if verdict is None or not verdict.why.startswith("crashed"):
        return verdict
    again = _in_child(run, timeout)
    if again is None:
        log.warning("a form's probe %s once and passed on the same inputs in a second child: taken as passed",
                    verdict.why)
    return again


def _in_child(run: Callable[[], str | None], timeout: float) -> Verdict | None:
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:                             # ENOMEM under strict overcommit, a pids limit
        os.close(r)
        os.close(w)
        return Verdict(f"could not fork a probe ({exc})", lasting=False)
    if pid == 0:                                       # the child: one thread, answer, exit without cleanup
        try:
            os.close(r)
            signal.alarm(int(timeout) + 5)             # gone even if the parent dies first
            faulthandler.disable()                     # its crash is the parent's finding, not a traceback
            signal.signal(signal.SIGBUS, signal.SIG_DFL)   # nor an exit 75 (the services' SIGBUS handler)
            torch.set_num_threads(1)
            why = run()
            os.write(w, (why or "").encode()[:4000])
        except BaseException as exc:  # noqa: BLE001 (reported to the parent, which decides)
            os.write(w, f"\0raised {type(exc).__name__}: {exc}".encode()[:4000])
        finally:
            os._exit(0)
    os.close(w)
    chunks, deadline, reaped = [], time.monotonic() + timeout, False
    try:
        while True:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return Verdict(f"hung (no answer in {timeout:g} s)", lasting=False)
            data = os.read(r, 4096)
            if not data:
                break
            chunks.append(data)
        _, status = os.waitpid(pid, 0)
        reaped = True
    finally:
        os.close(r)
        if not reaped:                                 # a hang, or this process interrupted: no orphan, no zombie
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return Verdict(f"crashed ({signal.Signals(os.WTERMSIG(status)).name})")
    said = b"".join(chunks).decode(errors="replace")
    if said.startswith("\0"):
        return Verdict(said[1:], lasting=False)
    return Verdict(said) if said else None
