"""`make demo`: build (once) a tiny trained MoE, serve it with 2 expert workers, generate, print timings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import finish
from benchmarks.demo_model import TRAIN_STEPS, build_demo_model
from colibri.client import Client, make_request
from colibri_common.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / ".cache" / "demo-model"
PROMPTS = ["letters: g h i j", "days: friday, saturday,", "count: 41 42 43"]
MAX_TOKENS = 40


def ensure_demo_model() -> None:
    if not (MODEL / "model.safetensors").is_file():
        torch.set_num_threads(os.cpu_count() or 1)
        print(f"building the demo checkpoint in {MODEL} ({TRAIN_STEPS} training steps, once)")
        build_demo_model(MODEL)


def through_grpc(client: Client, prompt: str, stop_ids: list[int]) -> tuple[str, int, float, float]:
    """(text, tokens, TTFT s, total s) of one streamed request through the gRPC client."""
    t_start = time.perf_counter()
    first, n, text = None, 0, ""
    for msg in client.stream(make_request(prompt, MAX_TOKENS, stop_token_ids=stop_ids)):
        if msg.WhichOneof("response") == "chunk":
            first = first or time.perf_counter()
            n += len(msg.chunk.token_ids)
            text += msg.chunk.text
    return text.rstrip("\n"), n, (first or t_start) - t_start, time.perf_counter() - t_start


def through_openai(api, prompt: str) -> tuple[str, int, float, float]:
    """The same through the official `openai` package against the local HTTP front (stop string "\\n")."""
    t_start = time.perf_counter()
    first, text, n = None, "", 0
    stream = api.completions.create(model=MODEL.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    stop=["\n"], stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            text += chunk.choices[0].text
        if chunk.usage:
            n = chunk.usage.completion_tokens
    return text, n, (first or t_start) - t_start, time.perf_counter() - t_start


def report(door: str, text: str, n: int, ttft: float, total: float) -> None:
    rate = (n - 1) / (total - ttft) if n > 1 and total > ttft else float("nan")
    print(f"  {door:<14}{text!r}\n  {'':<14}{n} tokens, time to first token {ttft * 1e3:.1f} ms, {rate:.1f} tokens/s")


def main() -> int:
    import openai

    ensure_demo_model()
    colibri = Path(sys.executable).parent / "colibri"
    t0 = time.perf_counter()
    fleet = subprocess.Popen([str(colibri), "serve", "--model", str(MODEL), "--workers", "2", "--port", "0",
                              "--openai-port", "0", "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True)
    same = True
    try:
        front = fleet.stdout.readline()  # type: ignore[union-attr]
        line = fleet.stdout.readline()  # type: ignore[union-attr]
        if not (front.startswith("openai ") and line.startswith("ready ")):
            print("colibri serve failed to start", file=sys.stderr)
            return 1
        addr, base = line.split()[1], front.split()[1]
        print(f"fleet ready in {time.perf_counter() - t0:.1f}s: router + 2 expert workers, gRPC at {addr}, "
              f"OpenAI-compatible HTTP at {base}\n")
        client = Client(addr)
        api = openai.OpenAI(base_url=base, api_key="not-needed")
        # the continuation stops at the end of its line: a stop token over gRPC, a stop string over HTTP
        stop_ids = [Tokenizer.from_dir(MODEL).token_to_id("\n")]  # type: ignore[union-attr]
        for prompt in PROMPTS:
            print(f"prompt:         {prompt!r}")
            g = through_grpc(client, prompt, stop_ids)
            o = through_openai(api, prompt)
            report("gRPC client", *g)
            report("openai (HTTP)", *o)
            same = same and g[0] == o[0]
            print()
        client.close()
        print("both doors gave the same text" if same else "the two doors DISAGREE (a bug: please report it)")
    finally:
        fleet.send_signal(signal.SIGTERM)
        fleet.wait(timeout=60)
    print("fleet stopped")
    return 0 if same else 1


if __name__ == "__main__":
    finish(main())
