"""Weight-only int8 experts against bf16 x and against float32 x, in one process, alternating: the expert side of a
MoE layer (`kernels.fused_moe`, the native `moe_`) on the bench shapes (E=64, H=1024, I=512, top-8; three layers'
experts, fresh routing every call, so the weights come from memory), called with the same tokens as bf16 (the
serving dtype: on a level with the int16 form, `native.int8_x16()`, x is quantised to int16 in blocks and multiplied
with integer multiply-adds) and as float32 (the float32 form on every level). A round times each for `--seconds`,
the order alternating; the ratio is the median of the rounds' ratios, so a drift of this VM's speed between rounds
cancels out. On a level without the int16 form both run the float32 form and the ratio is ~1.

    python -m benchmarks.int8_x_ab [--tokens 1,8,32] [--threads 1,2] [--rounds 7] [--seconds 0.6] [--size bench]

`--size small`: the small bench model's expert shapes instead (E=32, H=768, I=384, top-4; benchmarks/bench_model.py).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench_model import SIZES
from benchmarks.common import finish, machine, publish, table
from benchmarks.native_kernels import Cycle, make
from kernels import fused_moe, native, topk_route


def per_call(cyc: Cycle, seconds: float) -> float:
    """Seconds a call, over calls for at least `seconds` after a short warm-up."""
    for _ in range(5):
        fused_moe(*cyc.next())
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        fused_moe(*cyc.next())
        n += 1
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,32", help="tokens a call (default: %(default)s)")
    ap.add_argument("--threads", default="1,2", help="thread counts (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=7, help="alternating rounds (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=0.6, help="time a form per round (default: %(default)s)")
    ap.add_argument("--size", choices=sorted(SIZES), default="bench",
                    help="whose expert shapes (benchmarks/bench_model.py; default: %(default)s)")
    args = ap.parse_args()
    size = SIZES[args.size]
    E, H, I, K = (size["num_experts"], size["hidden_size"], size["moe_intermediate_size"],
                  size["num_experts_per_tok"])
    if not native.available():
        raise SystemExit(f"int8_x_ab: the native kernels are not built ({native.describe()})")
    g = torch.Generator().manual_seed(0)
    layers = [(make("int8", E, 2 * I, H, g=g), make("int8", E, H, I, g=g)) for _ in range(3)]
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for T in (int(t) for t in args.tokens.split(",")):
            calls: dict[torch.dtype, list[tuple]] = {torch.bfloat16: [], torch.float32: []}
            for j in range(24):
                x = torch.randn(T, H, generator=g).to(torch.bfloat16)                      # [T, H]
                w, ids = topk_route(torch.randn(T, E, generator=g), K, True)               # [T, K]
                for dt, out in calls.items():
                    out.append((x.to(dt), *layers[j % len(layers)], ids, w))
            cycles = {dt: Cycle(c) for dt, c in calls.items()}
            times: dict[torch.dtype, list[float]] = {dt: [] for dt in cycles}
            for r in range(args.rounds):
                for dt in (list(cycles) if r % 2 else list(cycles)[::-1]):
                    times[dt].append(per_call(cycles[dt], args.seconds))
            bf, fp = times[torch.bfloat16], times[torch.float32]
            ratios = [f / b for f, b in zip(fp, bf, strict=True)]
            rows.append([str(threads), str(T), f"{1e3 * statistics.median(bf):.3f}",
                         f"{1e3 * statistics.median(fp):.3f}", f"{statistics.median(ratios):.2f}x",
                         f"{min(ratios):.2f}-{max(ratios):.2f}x"])
            print(" | ".join(rows[-1]), flush=True)
    publish("\n".join([
        "# Weight-only int8 experts: bf16 x against float32 x", "",
        f"Machine: {machine()}; native kernels: {native.isa()} (int16 form for bf16 x: "
        f"{'yes' if native.int8_x16() else 'no'}).",
        f"Command: `python -m benchmarks.int8_x_ab --tokens {args.tokens} --threads {args.threads} "
        f"--rounds {args.rounds} --seconds {args.seconds:g} --size {args.size}` (experts E={E}, H={H}, I={I}, "
        f"top-{K}). ms: medians over the rounds; bf16 x faster by: the "
        "median of the rounds' float32 / bf16 ratios, and their range.", "",
        table(["threads", "tokens", "bf16 x ms", "float32 x ms", "bf16 x faster by", "rounds' range"], rows)]),
        "int8_x_ab" if args.size == "bench" else f"int8_x_ab-{args.size}")


if __name__ == "__main__":
    finish(main())
