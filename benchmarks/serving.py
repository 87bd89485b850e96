"""`make bench`: Colibri against transformers on the bench model, in one run, on this machine.

Colibri: `colibri serve` with 1 and 2 expert workers (real processes, gRPC on loopback, driven by the
`colibri bench` load generator) and the in-process mode (every expert in the router's process, no gRPC).
transformers: `generate` with the fastest of its experts implementations, same weights, same dtype.
llama.cpp: bf16 and q8_0 through `llama-batched-bench` whenever a build is at hand (benchmarks/llamacpp.py says
where one comes from), with the ratios of every Colibri row to it.
Output tok/s at 1, 8 and 32 concurrent streams (16-token prompts, 64 new tokens), TTFT and inter-token
latency p50/p99, cold start (process start → ready / loaded), peak RSS of every process, % of the
memory-bandwidth roofline, the engine's time split, and where a llama.cpp build was at hand the verdict on each
serving target of the native-kernels issue (benchmarks/targets.py). Writes benchmarks/results/serving.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
from tqdm import tqdm

from benchmarks.bench_model import SIZES, ensure_bench_model
from benchmarks.common import ReadProbe, finish, machine, page_state, publish, table
from benchmarks.llamacpp import add_peer_args, find_peer
from benchmarks.llamacpp import measure as measure_llamacpp
from benchmarks.targets import orchestration, step_seconds, targets_section
from colibri.fleet import colibri_command
from colibri.loadgen import run_load
from colibri_common.config import ModelConfig
from router_service.engine.metrics import parse

PY = sys.executable
COLIBRI = colibri_command()          # the console script, or `python -m colibri.cli` where none is installed


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def step_bytes(cfg: ModelConfig, streams: int, itemsize: int, expert_itemsize: int) -> float:
    """Weight bytes one decode step must read: dense + lm_head + the experts the batch touches (expected)."""
    H, I, E, K = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.top_k
    attn = H * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.num_heads * cfg.head_dim * H
    dense = cfg.num_layers * (attn + E * H) + cfg.vocab_size * H
    touched = E * (1 - (1 - K / E) ** streams)
    return dense * itemsize + len(cfg.moe_layers) * touched * 3 * H * I * expert_itemsize


def kill_a_worker_after(serve_pid: int, seconds: float) -> threading.Timer:
    """SIGKILL the fleet's last expert worker `seconds` from now (serve restarts it)."""
    def kill() -> None:
        workers = [c for c in psutil.Process(serve_pid).children() if " expert " in f" {' '.join(c.cmdline())} "]
        if workers:
            workers[-1].send_signal(signal.SIGKILL)

    t = threading.Timer(seconds, kill)
    t.start()
    return t


def run_fleet(model: Path, workers: int, dtype: str, streams: list[int], prompt_len: int, max_tokens: int,
              extra: list[str], kill_after: float | None = None) -> dict:
    with socket.socket() as sock:        # a free port for the fleet's /metrics
        sock.bind(("127.0.0.1", 0))
        mport = sock.getsockname()[1]
    t0 = time.perf_counter()
    p = subprocess.Popen([*COLIBRI, "serve", "--model", str(model), "--workers", str(workers), "--port", "0",
                          "--dtype", dtype, "--metrics-port", str(mport), "--log-level", "WARNING", *extra],
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("ready "):
            raise RuntimeError(f"colibri serve failed: {line!r}")
        cold = time.perf_counter() - t0
        addr = line.split()[1]
        rows = {}
        run_load(addr, 1, 1, prompt_len, 4)                       # warm-up
        for c in streams:
            before = parse(urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics").read().decode())
            killer = None if kill_after is None else kill_a_worker_after(p.pid, kill_after)
            r = run_load(addr, c, c, prompt_len, max_tokens)
            if killer is not None:
                killer.join()
                wait_serving(addr)                                # the restarted worker is back
            after = parse(urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics").read().decode())
            phases = {k.split('"')[1]: after[k] - before.get(k, 0.0) for k in after
                      if k.startswith("colibri:engine_phase_seconds_total")}
            rows[c] = {k: getattr(r, k) for k in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                                  "itl_p99_ms", "requests_failed")}
            rows[c]["phases"] = phases
            rows[c]["balance"] = after.get("colibri:expert_balance", float("nan"))
        procs = psutil.Process(p.pid).children()
        rss = [peak_rss(c.pid) for c in procs]
        return {"cold_start_s": cold, "rows": rows, "peak_rss": rss}
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)


def wait_serving(addr: str, timeout: float = 120) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(addr) as ch:
        while time.monotonic() < deadline:
            try:
                if health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="colibri.v1.Generation"),
                                                        timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)


def run_json(module: str, args: list[str]) -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    out = subprocess.run([PY, "-m", module, *args], capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{module} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llamacpp_section(llama: dict, results: dict, streams: list[int]) -> list[str]:
    """llama.cpp's rows and each Colibri engine's ratio to them (output tok/s, prefill included on both sides);
    int8 and w8a8 engines against q8_0 too."""
    if not llama:
        return ["", "## Against llama.cpp", "", "Not measured in this run: no llama.cpp build at hand "
                "(benchmarks/llamacpp.py: --llamacpp-bin with --llamacpp-gguf, or the peer script)."]
    source = next(iter(llama.values()))["source"]
    peer_rows = [[f"llama.cpp {q}", str(c), f"{r['rows'][c].decode_tokens_per_s:.1f}",
                  f"{r['rows'][c].output_tokens_per_s:.1f}"] for q, r in llama.items() for c in streams
                 if c in r["rows"]]
    ratio_rows = []
    for name, res in results.items():
        if not name.startswith("colibri"):
            continue
        for c in streams:
            ours = res["rows"][str(c)] if str(c) in res["rows"] else res["rows"][c]
            cells = [name, str(c), f"{ours['output_tokens_per_s']:.1f}"]
            for q in ("bf16", "q8_0"):
                theirs = llama.get(q, {}).get("rows", {}).get(c)
                cells.append(f"{ours['output_tokens_per_s'] / theirs.output_tokens_per_s:.2f}x" if theirs else "-")
            ratio_rows.append(cells)
    return ["", "## Against llama.cpp", "", f"{source}; `llama-batched-bench` with the same prompt length, new tokens, "
            "streams and threads, run in this same benchmark.", "",
            table(["engine", "streams", "decode tok/s (S_TG)", "output tok/s (prefill included)"], peer_rows), "",
            table(["engine", "streams", "output tok/s", "vs llama.cpp bf16", "vs llama.cpp q8_0"], ratio_rows)]


def fmt_gib(values: list[int]) -> str:
    return " + ".join(f"{v / 2**30:.2f}" for v in values) + " GiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--engines", default="", help="comma-separated substrings (or =exact names): run only the "
                                                  "matching engines (transformers always runs, for the ratios); "
                                                  "the results go to serving-<engines>.md")
    ap.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp's rows out")
    ap.add_argument("--size", choices=sorted(SIZES), default="bench", help="the bench checkpoint's size "
                    "(benchmarks/bench_model.py): bench (892M parameters) or small (0.29B)")
    add_peer_args(ap)
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    peer, peer_line = (None, "llama.cpp: left out (--no-llamacpp)") if args.no_llamacpp else find_peer(
        args.llamacpp_bin, args.llamacpp_gguf, args.llamacpp_peer)
    print(peer_line, file=sys.stderr)
    model = ensure_bench_model(size=args.size)
    cfg = ModelConfig.from_dir(model)
    pages = page_state(model)
    common = ["--model", str(model), "--dtype", args.dtype, "--streams", args.streams,
              "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens)]
    jobs = [
        ("transformers", lambda: run_json("benchmarks.peer_hf", common)),
        ("colibri in-process", lambda: run_json("benchmarks.inprocess", common)),
        ("colibri 1 worker", lambda: run_fleet(model, 1, args.dtype, streams, args.prompt_len, args.max_tokens, [])),
        ("colibri 2 workers", lambda: run_fleet(model, 2, args.dtype, streams, args.prompt_len, args.max_tokens, [])),
        ("colibri 2 workers int8", lambda: run_fleet(model, 2, args.dtype, streams, args.prompt_len, args.max_tokens,
                                                     ["--quantize", "int8"])),
        ("colibri 2 workers int8 + dense int8", lambda: run_fleet(
            model, 2, args.dtype, streams, args.prompt_len, args.max_tokens,
            ["--quantize", "int8", "--quantize-dense"])),
        ("colibri 2 workers w8a8", lambda: run_fleet(model, 2, args.dtype, streams, args.prompt_len, args.max_tokens,
                                                     ["--quantize", "w8a8"])),
        ("colibri 2 workers batch-invariant", lambda: run_fleet(
            model, 2, args.dtype, streams, args.prompt_len, args.max_tokens, ["--batch-invariant"])),
        ("colibri 2 workers replicas 2", lambda: run_fleet(model, 2, args.dtype, streams, args.prompt_len,
                                                           args.max_tokens, ["--replicas", "2"])),
        ("colibri 2 workers replicas 2, one killed", lambda: run_fleet(
            model, 2, args.dtype, streams, args.prompt_len, args.max_tokens, ["--replicas", "2"], kill_after=1.5)),
    ]
    if args.engines:
        wanted = [w.strip() for w in args.engines.split(",")]
        jobs = [(n, j) for n, j in jobs if n == "transformers" or any(
            n == w[1:] if w.startswith("=") else w in n for w in wanted)]
    if peer is not None and args.dtype == "bfloat16":
        jobs.insert(1, ("llama.cpp", lambda: measure_llamacpp(peer, model, streams, args.prompt_len,
                                                               args.max_tokens, len(os.sched_getaffinity(0)))))
    results, rates = {}, {}
    for name, job in tqdm(jobs, desc="bench", unit="engine"):
        rates[name] = ReadProbe().gbs(min_seconds=0.5)    # before each run (this VM drifts); 1 GiB, freed after
        results[name] = job()
    llama = results.pop("llama.cpp", {})
    hf = results["transformers"]
    itemsize = 2 if args.dtype == "bfloat16" else 4
    rows = []
    for name, res in results.items():
        for c in streams:
            r = res["rows"][str(c)] if str(c) in res["rows"] else res["rows"][c]
            h = hf["rows"][str(c)]
            expert_itemsize = 1 if "int8" in name or "w8a8" in name else itemsize
            dense_itemsize = 1 if name.endswith("dense int8") else itemsize
            roof = c / (step_bytes(cfg, c, dense_itemsize, expert_itemsize) / (rates[name] * 1e9))
            rows.append([name, str(c), f"{r['output_tokens_per_s']:.1f}",
                         f"{r['output_tokens_per_s'] / h['output_tokens_per_s']:.2f}x",
                         f"{r['ttft_p50_ms']:.0f}", f"{r.get('ttft_p99_ms', float('nan')):.0f}",
                         f"{r['itl_p50_ms']:.0f}", f"{r.get('itl_p99_ms', float('nan')):.0f}",
                         f"{100 * r['output_tokens_per_s'] / roof:.0f}%"])
    cold = [[n, f"{r['cold_start_s']:.1f} s", f"{hf['cold_start_s'] / r['cold_start_s']:.2f}x", fmt_gib(r["peak_rss"])]
            for n, r in results.items()]
    split = []
    for name in [n for n in results if n.startswith("colibri") and n != "colibri in-process"]:
        for c in streams:
            ph = results[name]["rows"][c]["phases"]
            if (orch := orchestration(ph)) is None:
                continue
            total = step_seconds(ph)
            split.append([name, str(c), f"{100 * orch:.1f}%", f"{100 * ph.get('wait', 0) / total:.0f}%",
                          f"{100 * ph.get('expert_compute', 0) / total:.0f}%"])
    vs_llama = llamacpp_section(llama, results, streams)
    text = "\n".join([
        f"# Serving benchmark: the {'' if args.size == 'bench' else args.size + ' '}bench model ({cfg.architecture}, "
        f"{cfg.num_layers} layers, "
        f"{cfg.num_experts} experts top-{cfg.top_k}, hidden {cfg.hidden_size}), {args.dtype}",
        "", f"Machine: {machine()}; read rate before each engine's run (a streaming sum over 1 GiB): "
        f"{', '.join(f'{n} {r:.1f} GB/s' for n, r in rates.items())}; {pages}.",
        f"Command: `python -m benchmarks.serving --dtype {args.dtype}"
        f"{' --size ' + args.size if args.size != 'bench' else ''}"
        f"{' --engines ' + repr(args.engines) if args.engines else ''}` ({args.prompt_len}-token prompts, "
        f"{args.max_tokens} new tokens, one request per stream). transformers experts implementation: "
        f"{hf['experts_implementation']}.",
        "", "## Throughput and latency", "",
        table(["engine", "streams", "tok/s", "vs transformers", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
               "ITL p99 ms", "% roofline"], rows),
        "", "Roofline: streams ÷ (weight bytes a decode step must read ÷ the read rate before that engine's run); "
        "transformers' "
        "TTFT/ITL are per static batch (no p99).",
        *vs_llama,
        *(targets_section(llama, results, args.size, args.dtype) if llama else []),
        "", "## Cold start and memory", "",
        table(["engine", "start → ready", "vs transformers", "peak RSS per process"], cold),
        "", "## Where a Colibri decode step goes (engine phase counters)", "",
        table(["fleet", "streams", "orchestration (schedule, prepare, postprocess, dispatch/combine)",
               "blocked on workers",
               "worker compute (sum over workers)"], split),
        *replicas_section(results, streams),
        ""])
    publish(text, "serving" + ("" if args.size == "bench" else f"-{args.size}") + (
        "" if args.dtype == "bfloat16" else f"-{args.dtype}") + (
        "" if not args.engines else "-" + "".join(ch if ch.isalnum() else "-" for ch in args.engines).strip("-")))
    return 0


def replicas_section(results: dict, streams: list[int]) -> list[str]:
    """The replicas runs' table, where the engines had any."""
    rows = [[n, str(c), f"{results[n]['rows'][c]['output_tokens_per_s']:.1f}",
             str(results[n]['rows'][c]['requests_failed']), f"{results[n]['rows'][c]['balance']:.2f}"]
            for n in results if n.startswith("colibri 2 workers replicas") for c in streams]
    if not rows:
        return []
    return ["", "## Replicas and failover (the killed worker: SIGKILL 1.5 s into each run; serve restarts it)", "",
            table(["fleet", "streams", "tok/s", "requests failed", "expert balance (mean ÷ max rows per worker)"],
                  rows)]


if __name__ == "__main__":
    finish(main())
