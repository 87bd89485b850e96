"""Colibri with every expert in the router's process (no gRPC), run in its own process: prints one JSON object."""

from __future__ import annotations

import json
import resource
import time

T_START = time.perf_counter()

from colibri import LLM  # noqa: E402, I001  (first: it sets the OpenMP policy before benchmarks.common loads torch)
from benchmarks.common import engine_args, finish  # noqa: E402
from colibri.loadgen import measure, random_prompts  # noqa: E402
from router_service.engine.events import Failed, Finished, Tokens  # noqa: E402
from router_service.engine.sequence import Sampling, Sequence  # noqa: E402


def main() -> None:
    args = engine_args([("--micro-batches", {"type": int, "default": 1}),
                        ("--enforce-eager", {"action": "store_true", "help": "no CUDA graphs (GPU)"}),
                        ("--no-fused-layers", {"action": "store_true",
                                               "help": "each decode layer call by call (attention block, routing, "
                                                       "experts), not one native call: the A/B of decoder_layer"})])
    llm = LLM(args.model, 0, dtype=args.dtype, micro_batches=args.micro_batches, device=args.device,
              enforce_eager=args.enforce_eager)
    engine = llm.engine
    engine.model.fusion.fuse_layers = not args.no_fused_layers
    cold = time.perf_counter() - T_START

    def stream(prompt: list[int], max_tokens: int, rid: str):
        q = engine.submit(Sequence(rid, prompt, Sampling(max_tokens=max_tokens, ignore_eos=True)))
        while True:
            ev = q.get()
            if isinstance(ev, Tokens):
                yield len(ev.token_ids)
            elif isinstance(ev, Finished):
                return
            elif isinstance(ev, Failed):
                raise RuntimeError(ev.message)

    rows = {}
    for c in (int(s) for s in args.streams.split(",")):
        prompts = random_prompts(c, args.prompt_len, llm.built.cfg.vocab_size, seed=0)
        measure(stream, prompts[:1], 1, 2, tag=f"warm{c}")
        r = measure(stream, prompts, c, args.max_tokens, tag=f"c{c}")
        rows[c] = {k: getattr(r, k) for k in ("output_tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                                              "itl_p99_ms", "requests_failed")}
    llm.close()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"cold_start_s": cold, "rows": rows, "peak_rss": [peak]}))


if __name__ == "__main__":
    finish(main())
