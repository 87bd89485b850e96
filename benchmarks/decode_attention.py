"""Decode attention at long contexts: `native.decode_attention` (kernels/native/attention.h: each query row against
its keys where the paged cache holds them) against torch's SDPA on the same rows gathered out of the cache (the
torch form's work: gather, then attention), bench-model heads (16 query heads, 4 KV heads, head dim 64), bf16.

The cache is paged as the router's: each sequence holds blocks of 16 slots taken in a shuffled order, so its rows
are scattered over the cache as after a while of serving. Each call reads its keys and values from memory where
they exceed the L3 (B x C x 1 KiB a layer here). GB/s = the KV bytes the call reads / time.

    python -m benchmarks.decode_attention [--batch 1,8,32] [--context 128,1024,4096] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from benchmarks.common import finish, machine, publish, table, time_fn
from benchmarks.native_kernels import Cycle

HQ, HKV, D, BLOCK = 16, 4, 64, 16


def case(B: int, C: int, g: torch.Generator) -> tuple:
    """q [B, Hq, D], the cache k / v [S, Hkv, D], slots [B, C] (blocks of 16 in a shuffled order), lens [B]."""
    blocks = B * ((C + BLOCK - 1) // BLOCK)
    S = blocks * BLOCK
    k = torch.randn(S, HKV, D, generator=g).to(torch.bfloat16)                       # [S, Hkv, D]
    v = torch.randn(S, HKV, D, generator=g).to(torch.bfloat16)                       # [S, Hkv, D]
    q = torch.randn(B, HQ, D, generator=g).to(torch.bfloat16)                        # [B, Hq, D]
    order = torch.randperm(blocks, generator=g).view(B, -1)                          # [B, NB]
    slots = (order[:, :, None] * BLOCK + torch.arange(BLOCK)).reshape(B, -1)[:, :C].contiguous()   # [B, C]
    lens = torch.full((B,), C, dtype=torch.long)                                     # [B]
    return q, k, v, slots, lens


def torch_form(q, k, v, slots, lens) -> torch.Tensor:
    """The rows gathered, then SDPA with the KV heads repeated for their query heads."""
    B, C = slots.shape
    kk = k[slots].transpose(1, 2)                                                    # [B, Hkv, C, D]
    vv = v[slots].transpose(1, 2)                                                    # [B, Hkv, C, D]
    return F.scaled_dot_product_attention(q[:, :, None], kk, vv, enable_gqa=True)[:, :, 0]     # [B, Hq, D]


def main() -> int:
    from kernels import native

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,8,32", help="sequences B")
    ap.add_argument("--context", default="128,1024,4096", help="keys per sequence C")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not native.available():
        print("decode_attention: the native kernels are not built (make setup)", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    rows = []
    shapes = [(B, C) for B in map(int, args.batch.split(",")) for C in map(int, args.context.split(","))]
    for B, C in tqdm(shapes, desc="decode attention", unit="shape"):
        cases = [case(B, C, g) for _ in range(max(2, (96 << 20) // (B * C * HKV * D * 4) + 1))]   # past the L3
        kv_bytes = B * C * HKV * D * 2 * 2
        cyc = Cycle(cases)
        nat = time_fn(lambda cyc=cyc: native.decode_attention(*cyc.next(), None, D**-0.5), min_runs=5,
                      min_seconds=0.3)
        ref = time_fn(lambda cyc=cyc: torch_form(*cyc.next()), min_runs=3, min_seconds=0.3)
        rows.append([str(B), str(C), f"{kv_bytes / 2**20:.1f}", f"{nat * 1e3:.3f}", f"{kv_bytes / nat / 1e9:.1f}",
                     f"{ref * 1e3:.3f}", f"{ref / nat:.2f}x"])
    command = " ".join(["python -m benchmarks.decode_attention", *sys.argv[1:]])
    text = "\n".join([
        "# Decode attention at long contexts", "",
        f"Machine: {machine()}; native kernels: {native.isa()}.",
        f"Command: `{command}` ({args.threads} threads; a bf16 cache of blocks of {BLOCK} slots in a shuffled "
        f"order; {HQ} query heads on {HKV} KV heads of {D}; ms: median).", "",
        table(["B", "C", "KV MiB", "native ms", "GB/s", "torch form ms", "native faster by"], rows), ""])
    publish(text, "decode_attention")
    return 0


if __name__ == "__main__":
    finish(main())
