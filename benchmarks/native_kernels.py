"""`make bench-kernels` (second part): Colibri's native CPU kernels on the bench shapes, as a fraction of the
memory read rate, at 1 and 2 threads, beside torch's own kernels on the same weights.

- The expert side of one MoE layer (`kernels.fused_moe`: sort, the expert FFN of every expert with work, the
  routed weights, the sum), E=64 experts of H=1024 x I=512, top-8, at T = 1, 8, 32 tokens.
- The small-M linear on the router's dense shapes (qkv [1536, 1024], o [1024, 1024], lm_head [32000, 1024]); int8
  twice where the level has AMX tiles: the float path (form `native_int8`) and the weight widened to bf16 on the
  tiles (`native_int8_tiles`).

Weights in bf16, int8 (per-row scales, weight-only; bf16 activations) and W8A8 (int8 weights, the activations'
rows quantised to int8, exact int32 sums). The expert rows run twice: on 4 KiB pages (torch's own
allocations) and on 2 MiB pages (copies on anonymous memory advised MADV_HUGEPAGE), as in-place experts read a
checkpoint that the page cache holds in 2 MiB folios (`colibri_common/page_cache.py`). Every call reads weights
that are not in the caches: the expert weights span several layers (fresh routing each call) and each linear
cycles through copies of its weight totalling over 4x the L3. GB/s = weight bytes the call reads / time; "% read"
divides by a streaming sum over 1 GiB at the same thread count (the rate a decode step can reach), taken beside
each row: three rounds of a probe then the op, the share the median of the rounds' ratios ("read GB/s" the
probes' median), so a row's share holds while this VM's bandwidth drifts between rows.

    python -m benchmarks.native_kernels [--tokens 1,8,32] [--threads 1,2] [--pages 4k,2m]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

# torch's OpenMP threads wait passively, as in the services (kernels/__init__.py sets it before their first torch
# import): spinning, they took the second core from the native ops' own threads after every torch op of a call (a
# layer's bf16 experts at 8 tokens read 63% of the read rate that way, 117% waiting passively)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.common import Beside, ReadProbe, finish, machine, publish, table, time_fn
from colibri_common.huge_pages import onto_huge_pages
from kernels import FORMS, Int8Weight, fused_moe, fused_moe_cpu, native, quantize_int8, topk_route

H, I, E, K = 1024, 512, 64, 8
LINEARS = {"qkv": (1536, 1024), "o": (1024, 1024), "lm_head": (32000, 1024)}
POOL_BYTES = 256 * 2**20          # each weight's copies together: far past any L3


def weight_bytes(w: torch.Tensor | Int8Weight) -> int:
    return w.q.nbytes + w.scale.nbytes if isinstance(w, Int8Weight) else w.nbytes


def make(kind: str, *shape: int, g: torch.Generator) -> torch.Tensor | Int8Weight:
    w = torch.randn(*shape, generator=g) * 0.02
    return quantize_int8(w, w8a8=kind == "w8a8") if kind in ("int8", "w8a8") else w.to(torch.bfloat16)


class Cycle:
    """Calls that take the next of several inputs each time (no call finds its weights in the caches)."""

    def __init__(self, items: list) -> None:
        self.items, self.i = items, 0

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


def anon_huge_bytes() -> int:
    """This process's anonymous memory on 2 MiB pages (AnonHugePages, /proc/self/smaps_rollup); 0 without it."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0
    return sum(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("AnonHugePages:"))


def huge_copy(w: torch.Tensor | Int8Weight) -> torch.Tensor | Int8Weight:
    """A copy on anonymous memory aligned to 2 MiB and advised MADV_HUGEPAGE (colibri_common/huge_pages.py; the
    tensor where huge pages cannot be had, which the AnonHugePages line then shows)."""
    if isinstance(w, Int8Weight):
        return dataclasses.replace(w, q=onto_huge_pages([w.q])[0])
    return onto_huge_pages([w])[0]


def measured(b: Beside) -> list[str]:
    """The columns ms, GB/s, read GB/s, % read of a row."""
    return [f"{b.seconds * 1e3:.3f}" if b.seconds < 0.01 else f"{b.seconds * 1e3:.2f}", f"{b.gbs:.1f}",
            f"{b.read_gbs:.1f}", f"{100 * b.share:.0f}%"]


def expert_rows(kind: str, tokens: list[int], g: torch.Generator, torch_too: bool, probe: ReadProbe,
                huge: bool = False) -> list[list[str]]:
    layers = 3                                                           # 600 MB in bf16: no layer stays cached
    weights = [(make(kind, E, 2 * I, H, g=g), make(kind, E, H, I, g=g)) for _ in range(layers)]
    if huge:
        before = anon_huge_bytes()
        weights = [(huge_copy(a), huge_copy(b)) for a, b in weights]
        held = sum(weight_bytes(w) for pair in weights for w in pair)
        tqdm.write(f"experts {kind} on 2 MiB pages: {(anon_huge_bytes() - before) / 2**20:.0f} of "
                   f"{held / 2**20:.0f} MiB (AnonHugePages)")
    per_expert = weight_bytes(weights[0][0]) // E + weight_bytes(weights[0][1]) // E
    rows = []
    for T in tokens:
        cases = []
        for j in range(8 * layers):
            x = torch.randn(T, H, generator=g).to(torch.bfloat16)                        # [T, H]
            w, ids = topk_route(torch.randn(T, E, generator=g), K, True)                 # [T, K]
            cases.append((x, *weights[j % layers], ids, w))
        touched = sum(int(c[3].unique().numel()) for c in cases) / len(cases) * per_expert
        cyc = Cycle(cases)
        native.use_isa("")
        b = probe.beside(lambda cyc=cyc: fused_moe(*cyc.next()), touched, min_seconds=0.25)
        ref = ""
        if torch_too:                                  # the torch forms on the same calls (Colibri before)
            ref_s = time_fn(lambda cyc=cyc: fused_moe_cpu(*cyc.next(), form="loop"), min_runs=5,
                            min_seconds=0.5)
            ref = f"{touched / ref_s / 1e9:.1f}"
        name = f"experts {kind}{', 2 MiB pages' if huge else ''}"
        rows.append([name, str(T), f"{touched / 2**20:.0f}", *measured(b), ref])
    return rows


def linear_rows(kind: str, tokens: list[int], g: torch.Generator, probe: ReadProbe) -> list[list[str]]:
    rows = []
    for name, (dout, din) in LINEARS.items():
        one = make(kind, dout, din, g=g)
        copies = [one] + [make(kind, dout, din, g=g) for _ in range(max(1, POOL_BYTES // weight_bytes(one)) - 1)]
        nbytes = weight_bytes(one)
        # weight-only int8 on AMX: the float path (native_int8) and the widened tiles (native_int8_tiles), each a row
        ways = [False, True] if kind == "int8" and native.int8_tiles() else [False]
        for T, tiles in [(T, tiles) for tiles in ways for T in tokens]:
            x = torch.randn(T, din, generator=g).to(torch.bfloat16)                      # [T, Din]
            cyc = Cycle(copies)
            b = probe.beside(lambda x=x, cyc=cyc, tiles=tiles: native.linear(x, cyc.next(), tiles=tiles), nbytes,
                             min_seconds=0.15)
            if kind == "w8a8":                          # the torch form: torch._int_mm on the quantised rows
                t = time_fn(lambda x=x, cyc=cyc: FORMS["w8a8_intmm"].fn(x, cyc.next()), min_runs=5, min_seconds=0.3)
            elif kind == "int8":                        # torch's kernel takes the scales in x's dtype
                packed = Cycle([(c.q, c.scale.to(x.dtype)) for c in copies])
                t = time_fn(lambda x=x, p=packed: torch._weight_int8pack_mm(x, *p.next()), min_runs=5,
                            min_seconds=0.3)
            else:
                t = time_fn(lambda x=x, cyc=cyc: F.linear(x, cyc.next()), min_runs=5, min_seconds=0.3)
            label = f"{name} {kind}{' on tiles' if tiles else ''} [{dout}, {din}]"
            rows.append([label, str(T), f"{nbytes / 2**20:.1f}", *measured(b), f"{nbytes / t / 1e9:.1f}"])
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,32", help="row counts T (default: %(default)s)")
    ap.add_argument("--threads", default="1,2", help="thread counts (default: %(default)s)")
    ap.add_argument("--kinds", default="bfloat16,int8,w8a8", help="weight kinds (default: %(default)s)")
    ap.add_argument("--pages", default="4k,2m", help="the expert weights' page sizes: 4k (torch's allocations), "
                    "2m (2 MiB pages, as in-place experts on a page cache of 2 MiB folios) (default: %(default)s)")
    args = ap.parse_args()
    if not native.available():
        print(f"the native kernels are not available here ({native.UNAVAILABLE}): nothing to measure")
        return 1
    tokens = [int(t) for t in args.tokens.split(",")]
    kinds = args.kinds.split(",")
    g = torch.Generator().manual_seed(0)
    sections = []
    probe = ReadProbe()
    for threads in tqdm([int(t) for t in args.threads.split(",")], desc="native kernels", unit="thread count"):
        torch.set_num_threads(threads)
        rows = []
        pages = args.pages.split(",")
        for kind in kinds:
            if "4k" in pages:
                rows += expert_rows(kind, tokens, g, torch_too=True, probe=probe)
            if "2m" in pages:
                rows += expert_rows(kind, tokens, g, torch_too=False, probe=probe, huge=True)
            rows += linear_rows(kind, tokens, g, probe)
        rates = sorted(float(r[5]) for r in rows)
        sections += [f"## {threads} thread{'s' if threads > 1 else ''}: read rate {rates[0]:.1f}-{rates[-1]:.1f} "
                     f"GB/s beside the rows (a streaming sum over 1 GiB)", "",
                     table(["op", "T", "MiB read", "ms", "GB/s", "read GB/s", "% read", "torch GB/s"], rows), ""]
    override = os.environ.get("COLIBRI_CPU_ISA")          # another level than CPUID's: a file of its own
    text = "\n".join([
        "# Native CPU kernels on the bench shapes", "",
        f"Machine: {machine()}; native kernels: {native.isa()}{' (COLIBRI_CPU_ISA)' if override else ''}.",
        f"Command: `{f'COLIBRI_CPU_ISA={override} ' if override else ''}python -m benchmarks.native_kernels` (part of "
        "`make bench-kernels`). torch GB/s: the expert "
        "side with the torch forms (`loop`, Colibri without native kernels), the linears with `F.linear` (bf16), "
        "`torch._weight_int8pack_mm` (int8) or `torch._int_mm` (W8A8), on the same weights.", "", *sections])
    publish(text, f"native_kernels-{native.isa()}" if override else "native_kernels")
    return 0


if __name__ == "__main__":
    finish(main())
