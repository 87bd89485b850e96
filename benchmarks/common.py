"""Shared benchmark helpers: timing, the machine's read rate (`ReadProbe`), the results table."""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from colibri_common import page_cache
from colibri_common.forms_file import cpu_isa, cpu_model, default_path, in_force
from colibri_common.heap import skip_exit_collection
from kernels import CANDIDATES

RESULTS = Path(__file__).resolve().parent / "results"


def publish(text: str, name: str) -> None:
    """Print a benchmark's report and keep it as benchmarks/results/NAME.md."""
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.md").write_text(text)


def finish(rc: int | None = 0) -> None:
    """Exit a benchmark's process without Python's last garbage collection (`skip_exit_collection`)."""
    skip_exit_collection()
    sys.exit(rc)


def time_fn(fn: Callable[[], object], min_runs: int = 5, min_seconds: float = 0.5, warmup: int = 2) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    t_end = time.perf_counter() + min_seconds
    while len(times) < min_runs or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) > 200:
            break
    return statistics.median(times)


@dataclass(frozen=True)
class Beside:
    """A call timed beside read probes (`ReadProbe.beside`): medians over the rounds."""

    seconds: float                 # a call
    gbs: float                     # the call's bytes / seconds
    read_gbs: float                # the probes'
    share: float                   # the call's GB/s ÷ the probe's, round by round, then the median


class ReadProbe:
    """Bytes read per second by a streaming sum over a buffer far larger than the caches: the rate a
    weight-streaming decode step can reach (a roofline divides by this, not by the copy rate). Taken again beside
    each measurement (`beside`, or before each engine of a serving run), for ratios that hold while this VM's
    bandwidth drifts: a benchmark that probed once and then ran for a minute divided by a rate from another phase
    (rows at 110-156% of a 15.1 GB/s probe, where a streaming sum read 26 GB/s minutes later). The buffer is made
    once (1 GiB, far past any L3); a probe is the median of a few sums over it."""

    def __init__(self, nbytes: int = 1024 * 2**20) -> None:
        self.nbytes = nbytes
        self.src = torch.ones(nbytes // 4, dtype=torch.float32)

    def gbs(self, min_seconds: float = 0.2) -> float:
        return self.nbytes / time_fn(lambda: self.src.sum(), min_runs=3, min_seconds=min_seconds, warmup=1) / 1e9

    def beside(self, fn: Callable[[], object], nbytes: float, rounds: int = 3, min_seconds: float = 0.3,
               min_runs: int = 10) -> Beside:
        """`rounds` times a probe, then fn timed (the median call); `nbytes` is what a call reads."""
        if rounds < 1:
            raise ValueError(f"rounds must be at least 1, got {rounds}")
        secs, rates = [], []
        for _ in range(rounds):
            rates.append(self.gbs())
            secs.append(time_fn(fn, min_runs=min_runs, min_seconds=min_seconds))
        s = statistics.median(secs)
        return Beside(s, nbytes / s / 1e9, statistics.median(rates),
                      statistics.median(nbytes / t / 1e9 / r for t, r in zip(secs, rates, strict=True)))


def machine() -> str:
    """The CPU, the ISA flags that decide the fast GEMM forms, cores, torch, its ATen kernel level, Python and
    the CPU forms in force (what the machine's forms file holds, with its rejects): every results file starts
    with this line, since a result measured on one CPU says little about another."""
    isa = " ".join(cpu_isa()) or "none found"
    forms = "; ".join(line.strip() for line in in_force(default_path(), CANDIDATES))
    return (f"{cpu_model()} (ISA: {isa}), {len(os.sched_getaffinity(0))} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads, ATen {torch.backends.cpu.get_cpu_capability()} kernels), "
            f"Python {platform.python_version()}; {forms}")


def page_state(model_dir: Path) -> str:
    """How the checkpoint's bytes sit in the page cache: the share on 2 MiB pages, which experts computed in place
    stream about 10% faster at 8 streams than 4 KiB ones (`docs/performance.md`). Every page is touched through a
    mapping of this process's own (read from the disk where not cached), then unmapped."""
    rss = pmd = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            page_cache.advise_huge(m)
            for off in range(0, len(m), mmap.PAGESIZE):
                m[off]
            share = page_cache.huge_share(path)
            if share is not None:
                rss, pmd = rss + share[0], pmd + share[1]
    if not rss:
        return "checkpoint page cache: not measured (no /proc/self/smaps)"
    return f"checkpoint page cache: {100 * pmd / rss:.0f}% of {rss / 2**30:.2f} GiB on 2 MiB pages"


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def engine_args(extra: list[tuple[str, dict]] | None = None) -> argparse.Namespace:
    """The arguments every side of the serving benchmark takes (each runs in its own process)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    for flag, kw in extra or []:
        ap.add_argument(flag, **kw)
    return ap.parse_args()
