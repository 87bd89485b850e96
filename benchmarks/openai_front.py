"""`make bench-openai`: what the OpenAI HTTP front costs over the gRPC API, at 1 and 32 streams.

One fleet (`colibri serve --openai-port 0`, 2 workers) on the demo checkpoint, whose model is tiny, so the
per-token cost of the extra hop (gRPC -> front -> JSON -> server-sent events -> client) shows instead of
hiding behind the model. The same random token-id prompts, greedy, exactly --max-tokens tokens each (EOS
ignored), go through the gRPC API (`colibri.loadgen`) and through POST /v1/completions with `stream: true`
(a plain http.client reader of the events, so the client's own parsing costs what the gRPC side's does);
both sides are timed by the same `loadgen.measure`. Each configuration runs twice, in alternating order (this
VM's speed swings run to run). transformers' `generate` on the same checkpoint is the peer beside them.
Writes benchmarks/results/openai_front.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import subprocess
from collections.abc import Iterator
from urllib.parse import urlparse

from tqdm import tqdm

from benchmarks.common import finish, machine, publish, table
from benchmarks.demo import MODEL, ensure_demo_model
from benchmarks.serving import COLIBRI, run_json
from colibri.client import Client
from colibri.loadgen import BenchResult, StreamFn, grpc_stream, measure, random_prompts


def http_stream(base: str, model: str, timeout: float = 600) -> StreamFn:
    u = urlparse(base)

    def stream(prompt: list[int], max_tokens: int, rid: str) -> Iterator[int]:
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        conn.request("POST", f"{u.path}/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        events = 0
        try:
            for line in resp:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):                 # the last event: count what the events did not show
                    yield chunk["usage"]["completion_tokens"] - events
                elif chunk["choices"]:
                    events += 1
                    yield 1
        finally:
            conn.close()

    return stream


def fmt(r: BenchResult) -> list[str]:
    return [f"{r.output_tokens_per_s:.1f}", f"{r.ttft_p50_ms:.1f}", f"{r.ttft_p99_ms:.1f}", f"{r.itl_p50_ms:.2f}",
            f"{r.itl_p99_ms:.2f}", str(r.requests_failed)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    ensure_demo_model()
    streams = [int(s) for s in args.streams.split(",")]
    peer_args = ["--model", str(MODEL), "--dtype", "float32", "--streams", args.streams, "--prompt-len",
                 str(args.prompt_len), "--max-tokens", str(args.max_tokens)]
    p = subprocess.Popen([*COLIBRI, "serve", "--model", str(MODEL), "--workers", "2", "--port", "0",
                          "--openai-port", "0", "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True)
    rows: list[list[str]] = []
    try:
        first = p.stdout.readline()  # type: ignore[union-attr]
        ready = p.stdout.readline()  # type: ignore[union-attr]
        if not (first.startswith("openai ") and ready.startswith("ready ")):
            raise RuntimeError(f"colibri serve failed: {first!r} {ready!r}")
        base, addr = first.split()[1], ready.split()[1]
        client = Client(addr)
        vocab = client.model_info().vocab_size
        sides = {"gRPC API": grpc_stream(client), "OpenAI HTTP (SSE)": http_stream(base, MODEL.name)}
        for side in sides.values():                                        # warm-up
            measure(side, random_prompts(2, args.prompt_len, vocab, 9), 2, 4)
        work = [(run, c) for run in range(args.runs) for c in streams]
        peers: dict[int, dict] = {}
        for run, c in tqdm(work, desc="bench-openai", unit="config"):
            if run not in peers:             # the peer beside each run (its own process, the fleet idle)
                peers[run] = run_json("benchmarks.peer_hf", peer_args)
            peer = peers[run]
            order = list(sides) if run % 2 == 0 else list(reversed(sides))
            results = {}
            for name in order:
                prompts = random_prompts(max(c, 2 * c if c > 1 else 4), args.prompt_len, vocab, seed=run)
                results[name] = measure(sides[name], prompts, c, args.max_tokens, tag=f"b{run}-{c}")
            base_tps = results["gRPC API"].output_tokens_per_s
            for name in sides:
                r = results[name]
                rows.append([str(c), str(run + 1), name, *fmt(r), f"{r.output_tokens_per_s / base_tps:.2f}x"])
            hf = peer["rows"][str(c)]
            rows.append([str(c), str(run + 1), "transformers generate", f"{hf['output_tokens_per_s']:.1f}",
                         f"{hf['ttft_p50_ms']:.1f}", "", f"{hf['itl_p50_ms']:.2f}", "", "0",
                         f"{hf['output_tokens_per_s'] / base_tps:.2f}x"])
        client.close()
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    headers = ["streams", "run", "API", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
               "failed", "tok/s vs gRPC"]
    out = "\n".join([
        "# OpenAI HTTP front vs the gRPC API (streaming overhead)", "",
        f"Machine: {machine()}", "",
        f"Command: `make bench-openai` (`python -m benchmarks.openai_front --streams {args.streams} --max-tokens "
        f"{args.max_tokens} --prompt-len {args.prompt_len} --runs {args.runs}`); the demo checkpoint "
        f"({MODEL.name}), float32, 2 workers and the front on this machine's cores, greedy, "
        f"{args.max_tokens} tokens per request, 2 x streams requests per configuration (4 at 1 stream).", "",
        table(headers, rows), "",
        "The front runs as its own process (Starlette on uvicorn with httptools); on 2 cores it competes with "
        "the router, the workers and the client for CPU, as it would on a small node. The transformers rows "
        "are `model.generate` on the same checkpoint in one process (static batches, `benchmarks/peer_hf.py`), "
        "run beside each round: on a model this small the fleet's per-step gRPC round trips, not the maths, set "
        "its speed, so transformers in one process is faster here; `make bench` compares the engines on a "
        "model of realistic shape.", ""])
    publish(out, "openai_front")
    return 0


if __name__ == "__main__":
    finish(main())
