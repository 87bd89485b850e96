"""`colibri tune`: measure the CPU linear forms for a model's shapes now, instead of at the first start.

It measures what `colibri serve --workers N` would: the router's dense shapes with the router's thread
count and one worker's expert shapes with a worker's, and writes them where the services look
(`--cpu-forms`), so the fleet's first start measures nothing.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from colibri.cores import split_threads
from colibri_common.flags import option
from colibri_common.options import DTYPE_CHOICES, QUANTIZE, check_threads, serving_dtype


@dataclass(frozen=True)
class TuneOptions:
    model: str = option("", "Hugging Face checkpoint directory", required=True, metavar="DIR")
    dtype: str = option("auto", "compute dtype, as for serve (auto = as the checkpoint)", choices=DTYPE_CHOICES)
    workers: int = option(2, "measure for this many workers (it decides each process's thread count)")
    threads: int = option(0, "cores to split between the router and the workers, as for serve (0 = all)")
    cpu_forms: str = option("auto", "where to write the forms ('auto' = where the services look)",
                            metavar="PATH|auto")
    max_rows: int = option(64, "largest row count to measure (rows beyond it use its winner)")
    quantize: str | None = option(None, "measure the int8 forms, as for serve --quantize int8 | w8a8",
                                  choices=QUANTIZE)

    def __post_init__(self) -> None:
        if self.workers <= 0 or self.max_rows <= 0:
            raise ValueError("--workers and --max-rows must be positive")
        check_threads(self.threads)
        if self.cpu_forms == "off":
            raise ValueError("--cpu-forms off measures nothing; give a path or 'auto'")


def run_tune(opts: TuneOptions) -> int:
    import torch

    from colibri_common.checkpoint import Checkpoint
    from colibri_common.config import ModelConfig
    from colibri_common.forms_file import measured_here, resolve, tune_forms, unwritable
    from expert_service.sizing import expert_linear_shapes, expert_moe_shape
    from kernels import describe_forms, weight_kind
    from router_service.api.build import compute_dtype
    from router_service.model.weights import RouterWeights

    cfg = ModelConfig.from_dir(opts.model)
    path = resolve(opts.cpu_forms)
    assert path is not None                             # 'off' is refused by the options
    # before the measuring, not after it; a file of this machine's forms may hold every one (shipped read-only):
    # then nothing is measured, and what is, is refused after (below)
    if (why := unwritable(path)) is not None and not measured_here(path):
        print(f"error: cannot write {path} ({why}); give --cpu-forms a writable path", file=sys.stderr)
        return 1
    router_threads, worker_threads = split_threads(opts.threads or len(os.sched_getaffinity(0)), opts.workers)
    dtype = getattr(torch, serving_dtype(opts.dtype, cfg.torch_dtype))
    router_dtype = compute_dtype(dtype)
    ckpt = Checkpoint(opts.model)
    weights = RouterWeights.load(ckpt, cfg, router_dtype)
    ckpt.close()
    expert_kind = weight_kind(opts.quantize, dtype)
    jobs = [("router", router_threads, weights.linear_shapes(router_dtype), []),
            ("expert worker", worker_threads, expert_linear_shapes(cfg, expert_kind),
             [expert_moe_shape(cfg, opts.workers, expert_kind)])]
    for role, threads, shapes, moe in jobs:
        torch.set_num_threads(threads)
        forms, measured = tune_forms(opts.cpu_forms, shapes, experts=role == "expert worker", moe=moe,
                                     max_rows=opts.max_rows)
        if forms.unsaved is not None:                   # writing them is tune's whole purpose: not a warning here
            print(f"error: cannot write {forms.path} ({forms.unsaved}); give --cpu-forms a writable path",
                  file=sys.stderr)
            return 1
        print(f"{role} ({threads} threads): {forms.summary(measured)}")
        print(f"  {describe_forms({k: forms.forms[k] for k in measured})}" if measured else "  nothing new to measure")
    return 0
