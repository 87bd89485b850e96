"""A form must be right before it may be fast: each candidate's result on the real shape against a float64
reference, and torch's own kernels that may crash on some CPU first run in a forked child.

`wrong(name, x, w)` compares one form's product with the float64 product of what is held (the dequantised
int8 weight; for W8A8 the per-row int8 activations too). A correct form differs by its accumulation and its
output's rounding; a wrong one (garbage from reads past a row, a wrong layout, NaN) by about the result
itself. The check is per row, relative to that row's norm, so one bad row cannot hide among good ones.

`isolated(run)` runs `run()` in a forked child with one torch thread (an OpenMP pool does not survive fork)
and reports a crash (the signal), a hang (the timeout) or the child's own verdict, so a kernel that takes a
process down on this CPU takes down only the probe.

Shapes: n rows of x, Din input features, Dout output features; W [Dout, Din].
"""

from __future__ import annotations

import faulthandler
import os
import select
import signal
import time
from collections.abc import Callable

import torch

from kernels.quant import Int8Weight, quantize_rows

# Largest per-row error ||y - ref|| / ||ref|| a correct form shows, by output dtype: the output's rounding
# (2^-9 for bf16, 2^-12 for fp16, 2^-24 for fp32) and float32 accumulation, with a wide margin. A form that
# rounded float32 activations to bf16 would show ~2^-9 and fail the float32 bound.
TOLERANCE = {torch.float32: 2.0**-14, torch.float16: 2.0**-8, torch.bfloat16: 2.0**-5}


def reference(x: torch.Tensor, w: torch.Tensor | Int8Weight) -> torch.Tensor:
    """The float64 product a form of this kind must compute: x [n, Din], w [Dout, Din] -> [n, Dout]."""
    if not isinstance(w, Int8Weight):
        return x.double() @ w.double().t()
    wd = w.q.double()                                                        # [Dout, Din]
    if w.w8a8:
        xq, xs = quantize_rows(x)
        return (xq.double() @ wd.t()) * xs.double()[:, None] * w.scale.double()
    return x.double() @ (wd * w.scale.double()[:, None]).t()


def wrong(y: object, x: torch.Tensor, w: torch.Tensor | Int8Weight, ref: torch.Tensor | None = None) -> str | None:
    """Why `y`, a form's result for x @ w.T, is wrong; None when it is right (`ref`: `reference(x, w)`, when the
    caller checks several forms on one input)."""
    n, dout = x.shape[0], w.shape[0]
    if not isinstance(y, torch.Tensor) or tuple(y.shape) != (n, dout) or y.dtype != x.dtype:
        got = f"{y.dtype} {list(y.shape)}" if isinstance(y, torch.Tensor) else type(y).__name__
        return f"returned {got}, not {x.dtype} [{n}, {dout}]"
    yd = y.double()
    if not bool(torch.isfinite(yd).all()):
        return "returned non-finite values"
    ref = reference(x, w) if ref is None else ref
    err = (yd - ref).norm(dim=1) / ref.norm(dim=1).clamp(min=1e-300)         # [n] per row
    worst = int(err.argmax())
    if float(err[worst]) > TOLERANCE.get(x.dtype, 2.0**-5):
        return (f"row {worst} of {n} is off by {float(err[worst]):.3g} of its norm against float64 (max error "
                f"{float((yd - ref).abs().max()):.3g})")
    return None


def isolated(run: Callable[[], str | None], timeout: float = 60.0) -> str | None:
    """Run `run()` (None = right, else why it is wrong) in a forked child; what went wrong, or None."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                       # the child: one thread, answer, exit without cleanup
        try:
            os.close(r)
            faulthandler.disable()                     # its crash is the parent's finding, not a traceback
            torch.set_num_threads(1)
            verdict = run()
            os.write(w, (verdict or "").encode()[:4000])
        except BaseException as exc:  # noqa: BLE001 (reported to the parent, which decides)
            os.write(w, f"raised {type(exc).__name__}: {exc}".encode()[:4000])
        finally:
            os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return f"hung (no answer in {timeout:g} s)"
            data = os.read(r, 4096)
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"crashed ({signal.Signals(os.WTERMSIG(status)).name})"
    return b"".join(chunks).decode(errors="replace") or None
