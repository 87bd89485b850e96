"""One decode row's attention block (`native.attention_block`: norm, qkv, q/k norms, rope, cache write, attention,
o) as the engine calls it: on a Python thread of its own (the engine's), 8 layers' weights in turn (out of the
caches between a layer's calls), a short stretch of Python between calls, against the same on the process's
main thread. It shows what the native ops' pool (kernels/native/pool.h) is for: torch's OpenMP threads sleep
between regions once a process has more than one Python thread running parallel ops, and each op then waits for
a wake-up; the pool's workers spin for COLIBRI_SPIN_US after each op (0 = sleep at once, as OpenMP did).

    python -m benchmarks.decode_block [--gap-us 100] [--context 200]

Each setting runs in a fresh process (the spin is read once per process); µs per block, median of 800 calls.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

SHAPES = {"small": (768, 12, 4, 64), "bench": (1024, 16, 4, 64)}      # hidden, heads, KV heads, head dim


def _child(shape: str, gap_us: float, context: int) -> dict:
    import torch

    from kernels import native

    torch.set_num_threads(2)
    H, Hq, Hkv, D = SHAPES[shape]
    L, S, dt = 8, 4096, torch.bfloat16
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, H, generator=g).to(dt)                                         # [T, H]
    ones = torch.ones(H, dtype=dt)
    wqkv = [(torch.randn((Hq + 2 * Hkv) * D, H, generator=g) / H**0.5).to(dt) for _ in range(L)]
    wo = [(torch.randn(H, Hq * D, generator=g) / (Hq * D) ** 0.5).to(dt) for _ in range(L)]
    norm = torch.ones(D, dtype=dt)
    cos, sin = torch.randn(1, D, generator=g).to(dt), torch.randn(1, D, generator=g).to(dt)   # [T, D]
    kc = [torch.randn(S, Hkv, D, generator=g).to(dt) for _ in range(L)]              # [S, Hkv, D]
    vc = [torch.randn(S, Hkv, D, generator=g).to(dt) for _ in range(L)]
    write, slots, lens = torch.tensor([context - 1]), torch.arange(context)[None], torch.tensor([context])

    def run() -> float:
        times = []
        for i in range(800):
            t = time.perf_counter()
            while time.perf_counter() - t < gap_us * 1e-6:                            # the engine's Python
                pass
            t0 = time.perf_counter()
            native.attention_block(h, ones, wqkv[i % L], None, norm, norm, False, cos, sin, kc[i % L], vc[i % L],
                                   write, slots, lens, None, wo[i % L], None, Hq, Hkv, 1e-6)
            times.append(time.perf_counter() - t0)
        return 1e6 * statistics.median(times[80:])

    main = run()
    torch.randn(1 << 22).sum()                        # the main thread's OpenMP pool exists, as after loading
    out: list[float] = []
    th = threading.Thread(target=lambda: out.append(run()))
    th.start()
    th.join()
    return {"main": main, "thread": out[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gap-us", type=float, default=100.0, help="Python time between two blocks (µs)")
    ap.add_argument("--context", type=int, default=200, help="keys each query attends to")
    ap.add_argument("--child", nargs=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child[0], args.gap_us, args.context)))
        return
    from benchmarks.common import machine, publish, table

    rows = []
    for shape in SHAPES:
        for spin in ("300", "0"):
            env = dict(os.environ, COLIBRI_SPIN_US=spin, OMP_WAIT_POLICY="PASSIVE")
            out = subprocess.run([sys.executable, "-m", "benchmarks.decode_block", "--child", shape, "--gap-us",
                                  str(args.gap_us), "--context", str(args.context)], env=env, capture_output=True,
                                 text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append([shape, spin, f"{r['main']:.0f}", f"{r['thread']:.0f}"])
    publish("\n".join([
        "# One decode row's attention block, on the main thread and on an engine thread", "",
        f"Machine: {machine()}.",
        f"Command: `python -m benchmarks.decode_block --gap-us {args.gap_us:g} --context {args.context}` (bf16, 2 "
        "threads, 8 layers' weights in turn; µs per block, median).", "",
        table(["model", "COLIBRI_SPIN_US", "main thread µs", "second thread µs"], rows)]), "decode_block")


if __name__ == "__main__":
    main()
