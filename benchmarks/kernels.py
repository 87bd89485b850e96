"""`make bench-kernels`: the fused MoE at the bench shape, side by side with its peers.

CPU: Colibri's CPU path (fp32 and bf16 weights) vs a naive per-expert Python loop vs transformers' own
experts module (grouped_mm) on the same weights, at H=1024, I=512, E=64, K=8, T in {1, 8, 32, 128};
achieved GB/s = bytes of the experts actually touched / time, against the read bandwidth measured beside
each case.
On a CUDA machine the Triton kernel is timed too (GB/s and TFLOP/s).
"""

from __future__ import annotations

import argparse

import torch
from tqdm import tqdm

from benchmarks.common import ReadProbe, finish, machine, publish, table, time_fn
from colibri_common.forms_file import tune_forms
from kernels import MoeShape, fused_moe, topk_route

H, I, E, K = 1024, 512, 64, 8


def naive_loop(x, w13, w2, ids, w):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gu = w13[e] @ x[t]
            out[t] += float(w[t, k]) * (w2[e] @ (torch.nn.functional.silu(gu[:I]) * gu[I:])).float()
    return out.to(x.dtype)


def hf_experts(w13: torch.Tensor, w2: torch.Tensor):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                         experts_implementation="grouped_mm")
    mod = Qwen3MoeExperts(cfg).to(w13.dtype)
    with torch.no_grad():
        mod.gate_up_proj.copy_(w13)
        mod.down_proj.copy_(w2)
    return mod


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,32,128", help="token counts T (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    # the CPU forms a worker of this machine would use for these shapes (measured once, kept in the forms file)
    tune_forms("auto", [(2 * I, H, k) for k in ("float32", "bfloat16")] + [(H, I, k) for k in ("float32", "bfloat16")],
               moe=[MoeShape(E, I, H, K, k) for k in ("float32", "bfloat16")])
    probe = ReadProbe()                           # the read rate beside each case (this VM's drifts)
    g = torch.Generator().manual_seed(0)
    w13_32 = torch.randn(E, 2 * I, H, generator=g) * 0.02
    w2_32 = torch.randn(E, H, I, generator=g) * 0.02
    rows = []
    cases = [(dt, T) for dt in (torch.float32, torch.bfloat16) for T in tokens]
    for dt, T in tqdm(cases, desc="bench-kernels", unit="case"):
        w13, w2 = w13_32.to(dt), w2_32.to(dt)
        hf = hf_experts(w13, w2)
        x = torch.randn(T, H, generator=g).to(dt)
        w, ids = topk_route(torch.randn(T, E, generator=g), K, True)
        touched = int(ids.unique().numel()) * 3 * H * I * dt.itemsize
        args = (x, w13, w2, ids, w)
        with torch.inference_mode():
            ours = probe.beside(lambda a=args: fused_moe(*a), touched)
            t_ours = ours.seconds
            t_hf = time_fn(lambda a=args, m=hf: m(a[0], a[3], a[4].to(a[0].dtype)))
            t_naive = time_fn(lambda a=args: naive_loop(*a), min_runs=2, min_seconds=0.2) \
                if T <= 32 else float("nan")
        rows.append([str(dt).removeprefix("torch."), str(T), f"{touched / 2**20:.0f}", f"{t_ours * 1e3:.2f}",
                     f"{t_naive * 1e3:.2f}", f"{t_hf * 1e3:.2f}", f"{t_hf / t_ours:.2f}x", f"{ours.gbs:.1f}",
                     f"{ours.read_gbs:.1f}", f"{100 * ours.share:.0f}%"])
    headers = ["dtype", "T", "MiB touched", "colibri ms", "naive loop ms", "transformers ms",
               "vs transformers", "GB/s", "read GB/s", "% of read bw"]
    out = [f"# Fused MoE kernels, H={H} I={I} E={E} K={K}", "", f"Machine: {machine()}",
           "Read bandwidth: a streaming sum over 1 GiB beside each case (three rounds of it then the kernel; the "
           "share is the median of the rounds' ratios). Every call here takes the same weights, so at few tokens "
           "the touched experts stay in the L3 (over 100%); `benchmarks/results/native_kernels.md` reads cold ones.",
           "",
           "CPU path (`kernels.fused_moe`, backend torch):", "",
           table(headers, rows)]
    if torch.cuda.is_available():
        out += ["", triton_section()]
    else:
        out += ["", "Triton: not run (no CUDA device on this machine)."]
    text = "\n".join(out) + "\n"
    publish(text, "kernels")
    return 0


def triton_section() -> str:
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    a = torch.empty(2**30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    bw = 2**30 / time_fn(lambda: (b.copy_(a), torch.cuda.synchronize())) / 1e9
    m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    flops = 2 * 8192**3 / time_fn(lambda: (m @ m, torch.cuda.synchronize())) / 1e12
    w13 = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device=dev, dtype=torch.bfloat16) * 0.02
    rows = []
    for T in (1, 8, 32, 128, 1024, 8192):
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)
        w, ids = topk_route(torch.randn(T, E, device=dev), K, True)
        touched = int(ids.unique().numel()) * 3 * H * I * 2
        s = time_fn(lambda a=(x, w13, w2, ids, w): (fused_moe(*a), torch.cuda.synchronize()))
        tflops = 2 * T * K * 3 * H * I / s / 1e12
        rows.append([str(T), f"{s * 1e6:.0f}", f"{touched / s / 1e9:.0f}", f"{100 * touched / s / 1e9 / bw:.0f}%",
                     f"{tflops:.1f}", f"{100 * tflops / flops:.0f}%"])
    return "\n".join([f"Triton on {props.name}: copy {bw:.0f} GB/s, bf16 matmul {flops:.0f} TFLOP/s", "",
                      table(["T", "µs", "GB/s", "% copy", "TFLOP/s", "% matmul"], rows)])


if __name__ == "__main__":
    finish(main())
