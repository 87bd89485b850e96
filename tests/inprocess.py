"""The router's engine with every expert in the test's own process: no processes, no gRPC.

For the checks that need the maths and the engine, not the fleet (architecture by architecture against
transformers, sampling, stop conditions, preemption). Real fleets stay for what needs processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from colibri import LLM
from router_service.engine.events import Failed, Finished, Outputs, Tokens
from router_service.engine.metrics import parse
from router_service.engine.sequence import Sampling, Sequence


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str = ""


class InProcess:
    """`colibri.LLM(workers=0)` with the engine's own doors open: raw sequences in, raw events out (tests read
    logits, metrics and the experts' cache). `opts` are LLM's (RouterOptions, ExpertCacheOptions fields)."""

    def __init__(self, model_dir: Path | str, dtype: str = "float32", wrap_experts=None, **opts) -> None:
        opts.setdefault("expert_cache_heat", "off")      # no test starts warm from another's run
        self.llm = LLM(model_dir, 0, dtype=dtype, wrap_experts=wrap_experts, **opts)
        self.built = self.llm.built
        self.engine = self.llm.engine
        self.shard = self.llm.shard.experts
        self._n = 0

    def submit(self, prompt: list[int], max_tokens: int, **sampling):
        self._n += 1
        return self.engine.submit(Sequence(f"r{self._n}", list(prompt), Sampling(max_tokens=max_tokens, **sampling)))

    def submit_all(self, prompts: list[list[int]], max_tokens: int, **sampling) -> list[Outputs]:
        """Every prompt waiting before the next step (Engine.together): the same batches run after run, not as the
        engine thread happens to wake between submissions."""
        with self.engine.together():
            return [self.submit(p, max_tokens, **sampling) for p in prompts]

    def metrics(self) -> dict[str, float]:
        return parse(self.engine.metrics.render())

    @staticmethod
    def collect(events) -> Result:
        res = Result()
        while True:
            ev = events.get(timeout=120)
            if isinstance(ev, Tokens):
                res.token_ids += ev.token_ids
                res.logits += [torch.frombuffer(bytearray(b), dtype=torch.float32) for b in ev.logits]
            elif isinstance(ev, Finished):
                res.finish_reason = ev.reason.value
                return res
            elif isinstance(ev, Failed):
                raise RuntimeError(f"{ev.code.name}: {ev.message}")

    def generate(self, prompt: list[int], max_tokens: int, **sampling) -> Result:
        return self.collect(self.submit(prompt, max_tokens, **sampling))

    def close(self) -> None:
        self.llm.close()

    def __enter__(self) -> InProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
