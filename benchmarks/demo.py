"""`make demo`: build (once) a tiny trained MoE, serve it with 2 expert workers, generate, print timings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.demo_model import TRAIN_STEPS, build_demo_model
from colibri.client import Client, make_request
from colibri_common.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / ".cache" / "demo-model"
PROMPTS = ["letters: g h i j", "days: friday, saturday,", "count: 41 42 43"]
MAX_TOKENS = 40


def main() -> int:
    if not (MODEL / "model.safetensors").is_file():
        torch.set_num_threads(os.cpu_count() or 1)
        print(f"building the demo checkpoint in {MODEL} ({TRAIN_STEPS} training steps, once)")
        build_demo_model(MODEL)
    colibri = Path(sys.executable).parent / "colibri"
    t0 = time.perf_counter()
    fleet = subprocess.Popen([str(colibri), "serve", "--model", str(MODEL), "--workers", "2", "--port", "0",
                              "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True)
    try:
        line = fleet.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("ready "):
            print("colibri serve failed to start", file=sys.stderr)
            return 1
        addr = line.split()[1]
        print(f"fleet ready at {addr} in {time.perf_counter() - t0:.1f}s (router + 2 expert workers)\n")
        client = Client(addr)
        # the continuation stops at the end of its line
        stop_ids = [Tokenizer.from_dir(MODEL).token_to_id("\n")]  # type: ignore[union-attr]
        for prompt in PROMPTS:
            t_start = time.perf_counter()
            first, n, text = None, 0, ""
            for msg in client.stream(make_request(prompt, MAX_TOKENS, stop_token_ids=stop_ids)):
                if msg.WhichOneof("response") == "chunk":
                    first = first or time.perf_counter()
                    n += len(msg.chunk.token_ids)
                    text += msg.chunk.text
            total = time.perf_counter() - t_start
            ttft = (first - t_start) * 1e3 if first else float("nan")
            decode_rate = (n - 1) / (total - ttft / 1e3) if n > 1 else float("nan")
            print(f"prompt:       {prompt!r}\ncontinuation: {text.rstrip()!r}")
            print(f"              {n} tokens, time to first token {ttft:.1f} ms, {decode_rate:.1f} tokens/s\n")
        client.close()
    finally:
        fleet.send_signal(signal.SIGTERM)
        fleet.wait(timeout=60)
    print("fleet stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
