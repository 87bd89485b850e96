"""Where the GPU path's time goes, for a session that is lent a GPU for minutes: torch.profiler over the Triton
fused MoE (bench-model shape, T = 1 and 64) and over decode steps of the in-process engine (bench model, bf16, 1 and
32 streams). Prints, for each, the ops with the most host (self CPU) time and the most device time, and the
engine's own phase times. `--device cpu` with TRITON_INTERPRET=1 runs it at toy sizes (the script's own check)."""

from __future__ import annotations

import argparse
import queue
import threading
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import finish
from benchmarks.gpu import SHAPES, sync
from router_service.engine.batch import Step
from router_service.engine.engine import Engine


def tables(prof: profile, rows: int, on_gpu: bool) -> str:
    avg = prof.key_averages()
    out = [avg.table(sort_by="self_cpu_time_total", row_limit=rows)]
    if on_gpu:
        out.append(avg.table(sort_by="self_device_time_total", row_limit=rows // 2))
    return "\n".join(out)


def profile_moe(device: torch.device, dtype: torch.dtype, shape: str, tokens: list[int], calls: int) -> None:
    from kernels import fused_moe, topk_route

    c = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(c.E, 2 * c.I, c.H, generator=g) * 0.02).to(device, dtype)      # [E, 2I, H]
    w2 = (torch.randn(c.E, c.H, c.I, generator=g) * 0.02).to(device, dtype)           # [E, H, I]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for T in tokens:
        x = torch.randn(T, c.H, generator=g).to(device, dtype)                          # [T, H]
        weights, ids = topk_route(torch.randn(T, c.E, generator=g).to(device), c.K, True)  # [T, K]
        for _ in range(3):
            fused_moe(x, w13, w2, ids, weights, backend="triton")
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fused_moe(x, w13, w2, ids, weights, backend="triton")
        sync(device)
        wall = (time.perf_counter() - t0) / calls
        with profile(activities=acts) as prof:
            for _ in range(calls):
                fused_moe(x, w13, w2, ids, weights, backend="triton")
            sync(device)
        print(f"\n### fused MoE {c.name}, T={T}: {wall * 1e6:.0f} µs a call (back to back, {calls} calls)\n")
        print(tables(prof, 30, device.type == "cuda"))


class StepProfiler:
    """torch.profiler over `steps` engine steps (execute and postprocess) from the first step that only decodes,
    entered and left on the engine's own thread (the profiler records the thread it is started on), with the
    engine's phase times over the same steps. Armed before the requests come, so a slow caller misses none.
    It wraps the engine's two step methods: a measuring tool's access, not an interface of the engine."""

    def __init__(self, engine: Engine, activities: list[ProfilerActivity]) -> None:
        self.engine, self.acts = engine, activities
        self.prof: profile | None = None
        self.result: profile | None = None
        self.left, self.t0, self.wall = 0, 0.0, 0.0
        self.phase0: dict[str, float] = {}
        self.phases: dict[str, float] = {}
        self.done = threading.Event()
        self.real_execute, self.real_post = engine._execute, engine._postprocess
        engine._execute, engine._postprocess = self.execute, self.postprocess

    def arm(self, steps: int) -> None:
        self.done.clear()
        self.left = steps

    def execute(self, step: Step) -> torch.Tensor:
        decode_only = all(s.num_new == 1 for mb in step.micro_batches for s in mb)
        if self.left and self.prof is None and decode_only:
            self.prof = profile(activities=self.acts)
            self.prof.__enter__()
            self.phase0, self.t0 = dict(self.engine.phase), time.perf_counter()
        return self.real_execute(step)

    def postprocess(self, step: Step, logits: torch.Tensor) -> None:
        self.real_post(step, logits)
        if self.prof is not None:
            self.left -= 1
            if self.left == 0:
                self.prof.__exit__(None, None, None)
                self.wall = time.perf_counter() - self.t0
                self.phases = {k: v - self.phase0[k] for k, v in self.engine.phase.items()}
                self.result, self.prof = self.prof, None
                self.done.set()


def profile_engine(model: str, device: str, dtype: str, streams: list[int], steps: int,
                   enforce_eager: bool = False) -> None:
    from colibri import LLM
    from colibri.loadgen import random_prompts
    from router_service.engine.events import Failed, Finished
    from router_service.engine.sequence import Sampling, Sequence

    llm = LLM(model, 0, dtype=dtype, device=device, enforce_eager=enforce_eager)
    engine = llm.engine
    graphs = "CUDA graphs" if engine.graphs is not None else "op by op"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    tracer = StepProfiler(engine, acts)

    def wait(q: queue.Queue, until: type) -> None:
        while True:
            ev = q.get(timeout=300)
            if isinstance(ev, Failed):
                raise RuntimeError(ev.message)
            if isinstance(ev, until):
                return

    for c in streams:
        prompts = random_prompts(c, 16, llm.built.cfg.vocab_size, seed=0)
        for n, tag in ((4, "warm"), (steps + 8, "run")):
            if tag == "run":
                tracer.arm(steps)
            queues = [engine.submit(Sequence(f"{tag}{c}-{i}", p, Sampling(max_tokens=n, ignore_eos=True)))
                      for i, p in enumerate(prompts)]
            for q in queues:
                wait(q, Finished)
        if not tracer.done.wait(60):
            raise RuntimeError(f"{steps} decode-only steps at {c} streams were not seen")
        per_step = ", ".join(f"{k} {v / steps * 1e3:.2f}" for k, v in sorted(tracer.phases.items()))
        print(f"\n### engine {dtype} on {device} ({graphs}), {c} streams: {steps} decode steps in "
              f"{tracer.wall * 1e3:.0f} ms "
              f"under the profiler; phases per step (ms): {per_step}\n")
        assert tracer.result is not None
        print(tables(tracer.result, 40, device.startswith("cuda")))
    llm.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="bench", help=f"fused-MoE shape, of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", default="1,64", help="token counts T for the fused MoE")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--model", default="", help="checkpoint for the engine part (default: the bench model)")
    ap.add_argument("--streams", default="1,32")
    ap.add_argument("--steps", type=int, default=10, help="decode steps profiled per stream count")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--enforce-eager", action="store_true", help="the engine's decode steps op by op (no CUDA "
                                                                 "graphs: each op's host time shows)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    profile_moe(device, dtype, args.shape, [int(t) for t in args.tokens.split(",")], args.calls)
    if not args.skip_engine:
        if args.model:
            model = args.model
        else:
            from benchmarks.bench_model import ensure_bench_model
            model = str(ensure_bench_model())
        profile_engine(model, args.device, str(dtype).removeprefix("torch."),
                       [int(s) for s in args.streams.split(",")], args.steps, args.enforce_eager)
    return 0


if __name__ == "__main__":
    finish(main())
