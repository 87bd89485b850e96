"""`make bench-cache`: the expert tiers on a skewed workload, beside transformers on the same checkpoint.

The checkpoint (`benchmarks/skewed_model.py`) routes each of 4 topics to its own quarter of the experts.
The workload: --requests prompts, topics shuffled, all sent at once to a router that runs at most
--max-batch-size sequences, so more wait than fit and the admission order matters. Each row is one
`colibri serve --workers 2` (bfloat16) with a worker cache setting; the columns:

- hit rate: the workers' expert-cache hits ÷ lookups during the run (1.0 with every expert packed);
- tok/s and P99 inter-token latency of the run (all requests together);
- worker RSS: the larger worker's resident memory after the run (psutil);
- start → ready: `serve` start to its `ready` line, from a cold page cache (the checkpoint's pages are
  dropped first with `posix_fadvise(DONTNEED)`, as on a fresh node); each configuration is started once
  before, so the CPU forms a new cache shape needs are measured then, not in this figure. The last row
  restarts the one before it with the hottest experts that run left (`--expert-cache-heat`);
- prefetch used / wasted: experts packed ahead on the router's prediction, then hit / evicted unused.

transformers runs the same prompts in static batches of --max-batch-size (`model.generate`, greedy).
Results: benchmarks/results/expert_cache.md, with the machine line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from tqdm import tqdm

from benchmarks.common import finish, machine, table
from benchmarks.serving import COLIBRI, PY, peak_rss
from benchmarks.skewed_model import ensure_skewed_model, topic_prompts
from colibri.loadgen import grpc_stream, measure
from colibri_common.config import ModelConfig
from router_service.engine.metrics import parse

RESULTS = Path(__file__).resolve().parent / "results" / "expert_cache.md"
HEAT = "heat"      # the configurations that write (the one before last) and read (the last) a heat file
CONFIGS = [  # name, capacity, policy, routing-aware batching, prefetch, heat
    ("all experts packed", "all", "lru", False, False, "off"),
    ("50% LRU, routing-aware, prefetch", "50%", "lru", True, True, "off"),
    ("25% LRU, FIFO", "25%", "lru", False, False, "off"),
    ("25% LRU, FIFO, prefetch", "25%", "lru", False, True, "off"),
    ("25% LRU, routing-aware", "25%", "lru", True, False, "off"),
    ("25% LFU, routing-aware, prefetch", "25%", "lfu", True, True, "off"),
    ("12.5% LRU, routing-aware, prefetch", "12.5%", "lru", True, True, "off"),
    ("25% LRU, routing-aware, prefetch", "25%", "lru", True, True, HEAT),
    ("25% LRU, routing-aware, prefetch, restarted warm", "25%", "lru", True, True, HEAT),
]


def scrape(port: int) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse(r.read().decode())


def drop_page_cache(model: Path) -> None:
    """Evict the checkpoint's clean pages from the page cache (no root needed), so a start reads from disk."""
    for f in model.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def start(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("ready "):
        p.kill()
        raise RuntimeError(f"colibri serve failed: {line!r}")
    return p, line.split()[1]


def stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    p.wait(timeout=60)


def run_config(model: Path, capacity: str, policy: str, aware: bool, prefetch: bool, heat: str,
               prompts: list[list[int]], args: argparse.Namespace) -> dict:
    from colibri.client import Client
    from colibri.fleet import free_ports

    mport = free_ports(1)[0]
    cmd = [*COLIBRI, "serve", "--model", str(model), "--workers", "2", "--port", "0", "--dtype", "bfloat16",
           "--metrics-port", str(mport), "--log-level", "WARNING", "--max-batch-size", str(args.max_batch_size),
           "--expert-cache-capacity", capacity, "--expert-cache-policy", policy,
           "--routing-aware-batching" if aware else "--no-routing-aware-batching",
           "--expert-prefetch" if prefetch else "--no-expert-prefetch"]
    if heat == HEAT:
        cmd += ["--expert-cache-heat", str(args.heat_dir / "heat-{shard}.json")]
    else:
        cmd += ["--expert-cache-heat", "off"]
    stop(start([*cmd[:cmd.index("--expert-cache-heat")], "--expert-cache-heat", "off"])[0])   # CPU forms measured
    drop_page_cache(model)
    t0 = time.perf_counter()
    p, addr = start(cmd)
    try:
        ready = time.perf_counter() - t0
        client = Client(addr)
        measure(grpc_stream(client), prompts[:2], 2, 4, tag="warm")              # warm-up
        before = [scrape(mport + 1 + w) for w in range(2)]
        r = measure(grpc_stream(client), prompts, len(prompts), args.max_tokens)
        after = [scrape(mport + 1 + w) for w in range(2)]
        client.close()

        def delta(name: str) -> float:
            return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True))

        hits, misses = delta("colibri:expert_cache_hits_total"), delta("colibri:expert_cache_misses_total")
        workers = [c for c in psutil.Process(p.pid).children() if "expert" in " ".join(c.cmdline())]
        return {"tok_s": r.output_tokens_per_s, "itl_p99_ms": r.itl_p99_ms, "failed": r.requests_failed,
                "hit_rate": hits / (hits + misses) if hits + misses else 1.0, "ready_s": ready,
                "rss": max(c.memory_info().rss for c in workers), "peak": max(peak_rss(c.pid) for c in workers),
                "used": delta("colibri:expert_cache_prefetch_used_total"),
                "wasted": delta("colibri:expert_cache_prefetch_wasted_total")}
    finally:
        stop(p)


def peer(model: str, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    """transformers on the same prompts, static batches: tok/s, inter-token latency, RSS, start → loaded."""
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    best, best_t = "eager", float("inf")
    for impl in ("grouped_mm", "batched_mm", "eager"):
        try:
            m.set_experts_implementation(impl)
            t1 = time.perf_counter()
            m.generate(torch.tensor(prompts[:batch]), max_new_tokens=2, min_new_tokens=2, do_sample=False)
            if time.perf_counter() - t1 < best_t:
                best, best_t = impl, time.perf_counter() - t1
        except Exception:  # noqa: BLE001 (an implementation this build lacks is skipped)
            continue
    m.set_experts_implementation(best)
    ready = time.perf_counter() - t0
    t1 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            m.generate(torch.tensor(prompts[i:i + batch]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                       do_sample=False)
    total = time.perf_counter() - t1
    rss = psutil.Process().memory_info().rss
    steps = -(-len(prompts) // batch) * max_tokens
    return {"tok_s": len(prompts) * max_tokens / total, "itl_ms": total / steps * 1e3, "rss": rss,
            "ready_s": ready, "experts_implementation": best}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--only", default="", help="comma-separated substrings: run only the matching rows")
    ap.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)   # the transformers side, as a child
    args = ap.parse_args()
    model = ensure_skewed_model()
    cfg = ModelConfig.from_dir(model)
    prompts, _ = topic_prompts(args.requests, args.prompt_len, cfg.vocab_size)
    if args.peer:
        print(json.dumps(peer(str(model), prompts, args.max_batch_size, args.max_tokens)))
        return 0
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    out = subprocess.run([PY, "-m", "benchmarks.expert_cache", "--peer", *sys.argv[1:]], capture_output=True,
                         text=True, env=env, check=True)
    hf = json.loads(out.stdout.strip().splitlines()[-1])
    configs = [c for c in CONFIGS if not args.only or any(w in c[0] for w in args.only.split(","))]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        args.heat_dir = Path(tmp)
        for name, *setting in tqdm(configs, desc="bench-cache", unit="config"):
            results[name] = run_config(model, *setting, prompts=prompts, args=args)
    full = results.get(CONFIGS[0][0])
    rows = [["transformers (static batches)", "-", f"{hf['tok_s']:.1f}", "1.00x", "-", f"{hf['itl_ms']:.0f} (mean)",
             f"{hf['rss'] / 2**20:.0f} MiB (whole model)", f"{hf['ready_s']:.1f} s", "-"]]
    for name, r in results.items():
        rows.append([name, f"{100 * r['hit_rate']:.1f}%", f"{r['tok_s']:.1f}", f"{r['tok_s'] / hf['tok_s']:.2f}x",
                     f"{r['tok_s'] / full['tok_s']:.2f}x" if full else "-", f"{r['itl_p99_ms']:.0f}",
                     f"{r['rss'] / 2**20:.0f} MiB" + (f" ({r['rss'] / full['rss']:.2f}x)" if full else ""),
                     f"{r['ready_s']:.1f} s" + (f" ({r['ready_s'] / full['ready_s']:.2f}x)" if full else ""),
                     f"{r['used']:.0f} / {r['wasted']:.0f}"])
    text = "\n".join([
        f"# Expert cache benchmark: skewed checkpoint ({cfg.architecture}, {cfg.num_layers} layers, "
        f"{cfg.num_experts} experts top-{cfg.top_k}, 4 topics), bfloat16, 2 workers",
        "", f"Machine: {machine()}", "",
        f"Command: `python -m benchmarks.expert_cache {' '.join(sys.argv[1:])}` ({args.requests} requests of "
        f"{args.prompt_len} prompt tokens from 4 topics, shuffled, all at once; {args.max_tokens} new tokens each; "
        f"--max-batch-size {args.max_batch_size}; transformers: {hf['experts_implementation']} experts)",
        "", table(["engine / worker cache", "hit rate", "tok/s", "vs HF", "vs all packed", "ITL p99 ms",
                   "worker RSS", "start → ready", "prefetch used / wasted"], rows), ""])
    print(text)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text)
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    finish(main())
