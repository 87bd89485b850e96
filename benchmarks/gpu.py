"""`make bench-gpu`: the GPU path, prepared to run the day a GPU is lent (one script, one results file).

1. Fused MoE (the Triton kernel in serving) against the HBM roofline at T = 1..256 tokens, on the bench
   model's expert shape and on Qwen3-30B-A3B's (128 experts top-8, hidden 2048, width 768), bf16. The
   roofline is the bytes the call must read (the experts the T tokens touch, plus activations) divided by
   the read rate measured on this GPU (a streaming sum over 1 GiB); the copy rate is reported beside it.
2. Serving tok/s at 1 / 8 / 32 / 128 streams on the bench model: `colibri serve --gpus 0` (router and two
   workers on the GPU) and the in-process engine (CUDA graphs, and --enforce-eager without them), against
   transformers `generate` on the same GPU.

`--device cpu` with TRITON_INTERPRET=1 runs the same code on a CPU at toy sizes (the test suite does, so
the script cannot rot while no GPU is at hand). Writes benchmarks/results/gpu.md (or --out).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.common import RESULTS, finish, machine, table
from benchmarks.serving import run_fleet, run_json


@dataclass(frozen=True)
class MoeCase:
    name: str
    E: int
    H: int
    I: int
    K: int


SHAPES = {"bench": MoeCase("bench model", 64, 1024, 512, 8),
          "qwen3-30b-a3b": MoeCase("Qwen3-30B-A3B", 128, 2048, 768, 8),
          "toy": MoeCase("toy", 8, 64, 32, 2)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, runs: int) -> float:
    """Median seconds per call, the device drained around each call."""
    fn()
    sync(device)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def device_rates(device: torch.device, nbytes: int) -> tuple[float, float]:
    """(read GB/s from a streaming sum, copy GB/s counting bytes read + written)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    read = nbytes / timed(lambda: src.sum(), device, 10) / 1e9
    copy = 2 * nbytes / timed(lambda: dst.copy_(src), device, 10) / 1e9
    return read, copy


def moe_section(device: torch.device, dtype: torch.dtype, shapes: list[MoeCase], tokens: list[int],
                runs: int, read_gbs: float) -> list[list[str]]:
    from kernels import fused_moe, topk_route

    rows = []
    g = torch.Generator().manual_seed(0)
    for c in shapes:
        w13 = (torch.randn(c.E, 2 * c.I, c.H, generator=g) * 0.02).to(device, dtype)      # [E, 2I, H]
        w2 = (torch.randn(c.E, c.H, c.I, generator=g) * 0.02).to(device, dtype)           # [E, H, I]
        for T in tqdm(tokens, desc=f"fused MoE {c.name}", unit="T"):
            x = torch.randn(T, c.H, generator=g).to(device, dtype)                          # [T, H]
            weights, ids = topk_route(torch.randn(T, c.E, generator=g).to(device), c.K, True)  # [T, K]
            call = lambda x=x, ids=ids, weights=weights, w13=w13, w2=w2: fused_moe(  # noqa: E731
                x, w13, w2, ids, weights, backend="triton")
            s = timed(call, device, runs)
            touched = int(torch.unique(ids).numel())
            nbytes = touched * 3 * c.H * c.I * dtype.itemsize + 2 * T * c.H * dtype.itemsize
            roof = nbytes / (read_gbs * 1e9)
            rows.append([c.name, str(T), str(touched), f"{s * 1e6:.0f}", f"{roof * 1e6:.0f}",
                         f"{nbytes / s / 1e9:.0f}", f"{100 * roof / s:.0f}%"])
    return rows


def serving_section(model: Path, device: str, streams: str, prompt_len: int, max_tokens: int, dtype: str
                    ) -> tuple[list[list[str]], str]:
    common = ["--model", str(model), "--dtype", dtype, "--streams", streams, "--prompt-len", str(prompt_len),
              "--max-tokens", str(max_tokens), "--device", device]
    place = ["--gpus", device.removeprefix("cuda:") if ":" in device else "0"] if device.startswith("cuda") else []
    counts = [int(s) for s in streams.split(",")]
    jobs = [("transformers", lambda: run_json("benchmarks.peer_hf", common)),
            ("colibri in-process", lambda: run_json("benchmarks.inprocess", common)),
            ("colibri in-process --enforce-eager",
             lambda: run_json("benchmarks.inprocess", [*common, "--enforce-eager"])),
            ("colibri serve, 2 workers", lambda: run_fleet(model, 2, dtype, counts, prompt_len, max_tokens, place))]
    results = {name: job() for name, job in tqdm(jobs, desc="serving", unit="engine")}
    hf = results["transformers"]
    rows = []
    for name, res in results.items():
        for c in counts:
            r = res["rows"].get(str(c)) or res["rows"][c]
            h = hf["rows"].get(str(c)) or hf["rows"][c]
            rows.append([name, str(c), f"{r['output_tokens_per_s']:.1f}",
                         f"{r['output_tokens_per_s'] / h['output_tokens_per_s']:.2f}x",
                         f"{r['ttft_p50_ms']:.0f}", f"{r['itl_p50_ms']:.1f}"])
    return rows, hf["experts_implementation"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda[:N]; cpu runs the toy check under TRITON_INTERPRET=1")
    ap.add_argument("--shapes", default="bench,qwen3-30b-a3b", help=f"fused-MoE shapes, of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256", help="token counts T for the fused MoE")
    ap.add_argument("--runs", type=int, default=20, help="timed calls per fused-MoE case (median)")
    ap.add_argument("--model", default="", help="checkpoint for the serving part (default: the bench model)")
    ap.add_argument("--streams", default="1,8,32,128", help="concurrent streams for the serving part")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skip-serving", action="store_true", help="the kernel part only")
    ap.add_argument("--skip-moe", action="store_true", help="the serving part only (a long-context run: "
                                                            "--skip-moe --prompt-len 3000 --streams 1,8)")
    ap.add_argument("--out", default=str(RESULTS / "gpu.md"), help="results file (default: %(default)s)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench-gpu: this machine has no usable CUDA GPU; run it where one is (or --device cpu with "
              "TRITON_INTERPRET=1 for the toy check)", file=sys.stderr)
        return 2
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("bench-gpu: --device cpu runs the Triton kernels only under TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32   # bf16 is wrong in the interpreter
    shapes = [SHAPES[s] for s in args.shapes.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU, Triton interpreter)"
    probe = 1024 * 2**20 if device.type == "cuda" else 64 * 2**20
    read_gbs, copy_gbs = device_rates(device, probe)
    lines = [
        "# GPU benchmark: the Triton fused MoE and serving on the GPU", "",
        f"GPU: {gpu}; read {read_gbs:.0f} GB/s (streaming sum over {probe // 2**20} MiB), copy {copy_gbs:.0f} GB/s "
        f"(read + write). Host: {machine()}.",
        f"Command: `python -m benchmarks.gpu {' '.join(argv if argv is not None else sys.argv[1:])}`", ""]
    if not args.skip_moe:
        moe_rows = moe_section(device, dtype, shapes, tokens, args.runs, read_gbs)
        lines += [f"## Fused MoE ({str(dtype).removeprefix('torch.')}, Triton) against the read roofline", "",
                  table(["shape", "T", "experts touched", "µs", "roofline µs", "GB/s", "% roofline"], moe_rows), ""]
    print("\n".join(lines), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines))          # the kernel part stands if the serving part is cut short
    shown = len(lines)
    if not args.skip_serving:
        if args.model:
            model = Path(args.model)
        else:
            from benchmarks.bench_model import ensure_bench_model
            model = ensure_bench_model()
        serve_dtype = "bfloat16" if device.type == "cuda" else "float32"
        rows, impl = serving_section(model, args.device, args.streams, args.prompt_len, args.max_tokens, serve_dtype)
        lines += [f"## Serving ({serve_dtype}, {args.prompt_len}-token prompts, {args.max_tokens} new tokens; "
                  f"transformers experts implementation: {impl})", "",
                  table(["engine", "streams", "tok/s", "vs transformers", "TTFT p50 ms", "ITL p50 ms"], rows), ""]
    text = "\n".join(lines)
    print("\n".join(lines[shown:]))
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    finish(main())
