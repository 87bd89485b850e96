"""transformers side of the serving benchmark, run in its own process: prints one JSON object.

Static batches through `model.generate` (greedy, exactly M new tokens): tok/s, TTFT (a 1-token generate of
the same batch), inter-token latency ((total - TTFT) / (M - 1)), cold start (process start → loaded),
peak RSS. The experts implementation is the fastest of those transformers offers, measured first.
"""

from __future__ import annotations

import json
import resource
import time

T_START = time.perf_counter()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from benchmarks.common import engine_args, finish  # noqa: E402
from colibri.loadgen import random_prompts  # noqa: E402


def generate(model, prompts: list[list[int]], n: int) -> float:
    ids = torch.tensor(prompts, device=model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=0)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    args = engine_args()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    cold = time.perf_counter() - T_START
    probe = random_prompts(8, args.prompt_len, model.config.vocab_size, seed=1)
    best, best_t = None, float("inf")
    for impl in ("grouped_mm", "batched_mm", "eager"):
        try:
            model.set_experts_implementation(impl)
            generate(model, probe, 2)
            t = generate(model, probe, 4)
        except Exception:  # noqa: BLE001 (an implementation this build lacks is skipped)
            continue
        if t < best_t:
            best, best_t = impl, t
    model.set_experts_implementation(best)
    rows = {}
    for c in (int(s) for s in args.streams.split(",")):
        prompts = random_prompts(c, args.prompt_len, model.config.vocab_size, seed=0)
        generate(model, prompts, 2)
        ttft = generate(model, prompts, 1)
        total = generate(model, prompts, args.max_tokens)
        rows[c] = {"output_tokens_per_s": c * args.max_tokens / total, "ttft_p50_ms": ttft * 1e3,
                   "itl_p50_ms": (total - ttft) / (args.max_tokens - 1) * 1e3}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"cold_start_s": cold, "experts_implementation": best, "rows": rows, "peak_rss": [peak]}))


if __name__ == "__main__":
    finish(main())
