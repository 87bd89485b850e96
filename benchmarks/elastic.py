"""`make bench-elastic`: placement from load and live resizes, on a checkpoint whose routing is skewed.

The checkpoint (built once in .cache/, bfloat16): Qwen3-MoE, hidden 1024, 8 layers, 32 experts top-4, width 1024,
vocab 8192 (1.6 GB of experts: a step's expert work outweighs its round trips); every token's embedding carries one
direction d and the gates of experts 0..7 favour d, so most pairs go to those 8 experts: one quarter of the model,
all in the first worker's range under the contiguous plan of 2 or 4 workers (benchmarks/skewed_model.py's idea with
one topic).

The fleet: --workers `colibri expert` workers (default 2) started without --shard and a `colibri router
--redundant-experts N` that plans for them, all on this machine (1 thread each; the cores are shared, so a
balanced plan helps only as far as the busiest worker was the step's critical path, and more workers than
cores only add wake-ups). The run:

1. --streams greedy streams of --max-tokens each on the router's first (even, contiguous) plan: tok/s, the
   measured balance (mean ÷ max token-expert pairs per worker over the window) and P99 inter-token latency;
2. `colibri workers rebalance` (the Admin service): the time from the call to the switch, and the call's whole
   time (load, switch, release);
3. the same streams on the plan from the measured load: tok/s, balance, P99 ITL;
4. resizes while streams run: to half the workers and back, each timed from `set` to the switch; every stream's
   tokens are checked against the first run's (a resize changes no token).

Results: benchmarks/results/elastic.md, with the machine line.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import torch

from benchmarks.common import finish, machine, publish, table
from benchmarks.serving import COLIBRI
from colibri.health import is_serving
from colibri_common import page_cache

MODEL_DIR = Path(__file__).resolve().parent.parent / ".cache" / "bench-elastic-model-1024"
HOT = 8
TOKEN = "bench-elastic-fleet-token"


def ensure_model(path: Path = MODEL_DIR) -> Path:
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return path
    from transformers import AutoModelForCausalLM

    from benchmarks.skewed_model import skewed_config

    print(f"building the elastic bench checkpoint in {path} (once)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(skewed_config(hidden=1024, layers=8, experts=32, width=1024),
                                             dtype=torch.bfloat16)
    with torch.no_grad():
        d = torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(1))
        d /= d.norm()
        emb = model.model.embed_tokens.weight
        emb.copy_((emb.float() + 4 * d).to(emb.dtype))
        for layer in model.model.layers:
            w = layer.mlp.gate.weight                                       # [E, H]
            w[:HOT].copy_((w[:HOT].float() + 2 * d).to(w.dtype))
    model.save_pretrained(path)
    page_cache.drop_checkpoint(path)        # the next reader fills the page cache in 2 MiB pages
    return path


def start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)


def wait(address: str, service: str, p: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not is_serving(address, service):
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{address} did not serve {service}")
        time.sleep(0.2)


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def run_streams(client, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, float]:
    """Every prompt at once, greedy: (tokens per stream, output tok/s, P99 inter-token latency in ms)."""
    from colibri.client import make_request

    out: list[list[int]] = [[] for _ in prompts]
    gaps: list[float] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        last = None
        for msg in client.stream(make_request(prompts[i], max_tokens, ignore_eos=True), timeout=1200):
            if msg.WhichOneof("response") == "chunk" and msg.chunk.token_ids:
                now = time.perf_counter()
                with lock:
                    out[i] += list(msg.chunk.token_ids)
                    if last is not None:
                        gaps.append(now - last)
                last = now

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    gaps.sort()
    p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] * 1e3 if gaps else 0.0
    return out, sum(map(len, out)) / seconds, p99


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--redundant-experts", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2, help="expert workers (each 1 thread; on a 2-core machine more "
                                                           "workers than cores share them)")
    args = ap.parse_args()

    from colibri.client import Client
    from colibri.fleet import free_ports
    from colibri_common.pb import admin_pb2, admin_pb2_grpc
    from colibri_common.token_gate import with_token

    model = ensure_model()
    env = dict(os.environ, COLIBRI_FLEET_TOKEN=TOKEN, OMP_WAIT_POLICY="PASSIVE")
    n = args.workers
    ports = free_ports(n + 1)
    workers = [f"127.0.0.1:{p}" for p in ports[:n]]
    procs = [start([*COLIBRI, "expert", "--model", str(model), "--port", str(p), "--dtype", "bfloat16", "--threads",
                    "1", "--log-level", "WARNING"], env) for p in ports[:n]]
    router = f"127.0.0.1:{ports[n]}"
    try:
        for a, p in zip(workers, procs, strict=True):
            wait(a, "colibri.v1.ExpertWorker", p)
        procs.append(start([*COLIBRI, "router", "--model", str(model), "--workers", ",".join(workers), "--port",
                            str(ports[n]), "--dtype", "bfloat16", "--threads", "1", "--log-level", "WARNING",
                            "--redundant-experts", str(args.redundant_experts), "--placement-window", "1024"], env))
        wait(router, "colibri.v1.Generation", procs[-1])
        client = Client(router)
        admin = admin_pb2_grpc.AdminStub(with_token(grpc.insecure_channel(router), TOKEN))
        show = lambda: admin.ShowWorkers(admin_pb2.ShowWorkersRequest(), timeout=30)   # noqa: E731
        prompts = [[(37 * i + 11 * j) % 8000 + 1 for j in range(16)] for i in range(args.streams)]
        run_streams(client, prompts[:2], 4)                                          # warm-up
        tokens, before_tps, before_p99 = run_streams(client, prompts, args.max_tokens)
        before_balance = show().balance
        t0 = time.perf_counter()
        change = admin.Rebalance(admin_pb2.RebalanceRequest(), timeout=1200)
        rebalance_call = time.perf_counter() - t0
        after_tokens, after_tps, after_p99 = run_streams(client, prompts, args.max_tokens)
        after_balance = show().balance
        same = after_tokens == tokens
        resizes = []
        for target in (workers[:max(1, n // 2)], workers):                           # while streams run
            box: dict[str, object] = {}
            t = threading.Thread(target=lambda box=box: box.update(run=run_streams(client, prompts, args.max_tokens)))
            t.start()
            time.sleep(1.0)
            t1 = time.perf_counter()
            out = admin.SetWorkers(admin_pb2.SetWorkersRequest(workers=target), timeout=1200)
            call = time.perf_counter() - t1
            t.join()
            same = same and box["run"][0] == tokens                                   # type: ignore[index]
            resizes.append((len(target), out.seconds, call))
    finally:
        for p in reversed(procs):
            stop(p)
    rows = [["contiguous (the first plan)", f"{before_tps:.1f}", f"{before_balance:.3f}", f"{before_p99:.1f}"],
            [f"from load, {args.redundant_experts} redundant a layer", f"{after_tps:.1f}", f"{after_balance:.3f}",
             f"{after_p99:.1f}"]]
    text = "\n".join([
        "# Elastic expert parallelism: placement from load, live resizes",
        "",
        f"Machine: {machine()}",
        "",
        f"Command: `python -m benchmarks.elastic --streams {args.streams} --max-tokens {args.max_tokens} "
        f"--redundant-experts {args.redundant_experts} --workers {n}` (`make bench-elastic`). {n} workers (1 thread "
        f"each) and the router on this machine, bf16, {args.streams} greedy streams of {args.max_tokens} tokens, "
        f"16-token prompts.",
        "",
        table(["placement", "tok/s", "balance (mean/max pairs)", "P99 ITL ms"], rows),
        "",
        f"- Ratio after/before: {after_tps / before_tps:.2f}x tok/s; balance {before_balance:.3f} -> "
        f"{after_balance:.3f}.",
        f"- Rebalance: switched {change.seconds:.3f} s after the call began; the call took {rebalance_call:.3f} s "
        f"(load, switch, release). {change.message}.",
        *(f"- Resize to {n} workers while {args.streams} streams ran: switched after {s:.3f} s, the call took "
          f"{c:.3f} s." for n, s, c in resizes),
        f"- Every stream's tokens the same in all four runs: {'yes' if same else 'NO'}.",
        "",
    ])
    publish(text, "elastic")
    return 0 if same else 1


if __name__ == "__main__":
    finish(main())
    sys.exit(0)
