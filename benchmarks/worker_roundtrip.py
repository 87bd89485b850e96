"""One MoE layer's Forward to one expert worker over its same-host socket, timed from outside: the round trip
against the compute the worker reports (`compute_ms`: from its tensors decoded to its partial sums ready). What
is left is the per-layer price of being a separate process: the frames, protobuf, Python around the kernel and
two thread wake-ups. A `colibri serve --workers 2` fleet is started (through `colibri.LLM`); requests of one
token with top-k experts all held by worker 0 are sent back to back, with `--gap-us` of idle between them (the
router's own compute between two layers).

    python -m benchmarks.worker_roundtrip [--model .cache/bench-model-small] [--requests 1500] [--gap-us 500]
"""

from __future__ import annotations

import argparse
import glob
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import finish, machine, publish, table
from colibri import LLM
from colibri_common import wire
from colibri_common.config import ModelConfig
from colibri_common.frames import recv_frame, send_frame
from colibri_common.pb import expert_pb2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=".cache/bench-model-small", help="checkpoint directory (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=1500, help="Forward calls timed (default: %(default)s)")
    ap.add_argument("--gap-us", type=float, default=500.0, help="idle between two calls, µs (default: %(default)s)")
    args = ap.parse_args()
    cfg = ModelConfig.from_dir(Path(args.model))
    pattern = str(Path(tempfile.gettempdir()) / "colibri-fleet-*" / "worker-0.sock")   # the launcher's mkdtemp
    before = set(glob.glob(pattern))
    llm = LLM(args.model, 2, dtype="bfloat16")
    try:
        path = (set(glob.glob(pattern)) - before).pop()
        g = torch.Generator().manual_seed(0)
        trip, compute = [], []
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            for i in range(args.requests):
                ids = torch.randperm(cfg.num_experts // 2, generator=g)[:cfg.top_k][None].to(torch.int32)  # [1, K]
                req = expert_pb2.ForwardRequest(
                    layer=list(cfg.moe_layers)[i % len(cfg.moe_layers)], exact_sum=True,
                    hidden=wire.encode(torch.randn(1, cfg.hidden_size, generator=g).to(torch.bfloat16)),
                    topk_ids=wire.encode(ids), topk_weights=wire.encode(torch.full((1, cfg.top_k), 1 / cfg.top_k)))
                payload = req.SerializeToString()
                t0 = time.perf_counter()
                send_frame(s, 0, payload)
                status, reply = recv_frame(s, 1 << 30)
                trip.append(time.perf_counter() - t0)
                if status:
                    raise RuntimeError(f"worker 0 answered status {status}: {reply.decode(errors='replace')}")
                compute.append(expert_pb2.ForwardResponse.FromString(reply).compute_ms / 1e3)
                t = time.perf_counter()
                while time.perf_counter() - t < args.gap_us * 1e-6:
                    pass
    finally:
        llm.close()
    skip = len(trip) // 10
    rt, cm = 1e6 * statistics.median(trip[skip:]), 1e6 * statistics.median(compute[skip:])
    publish("\n".join([
        "# A Forward to one expert worker over its same-host socket", "",
        f"Machine: {machine()}.",
        f"Command: `python -m benchmarks.worker_roundtrip --model {args.model} --requests {args.requests} "
        f"--gap-us {args.gap_us:g}` (1 token, top-{cfg.top_k} experts of worker 0, bf16, medians).", "",
        table(["round trip µs", "worker compute_ms µs", "outside the compute µs"],
              [[f"{rt:.0f}", f"{cm:.0f}", f"{rt - cm:.0f}"]])]), "worker_roundtrip")


if __name__ == "__main__":
    finish(main())
