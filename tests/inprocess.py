"""The router's engine with every expert in the test's own process: no processes, no gRPC.

For the checks that need the maths and the engine, not the fleet (architecture by architecture against
transformers, sampling, stop conditions, preemption). Real fleets stay for what needs processes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from colibri_common.checkpoint import Checkpoint
from expert_service.shard import CacheSetting, ExpertShard
from router_service.build import BuiltEngine, build_engine
from router_service.events import Failed, Finished, Tokens
from router_service.experts import LocalExperts
from router_service.metrics import parse
from router_service.options import RouterOptions
from router_service.scheduler import SchedulerConfig
from router_service.sequence import Sampling, Sequence


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    finish_reason: str = ""


class InProcess:
    def __init__(self, model_dir: Path | str, dtype: str = "float32", sched: SchedulerConfig | None = None,
                 wrap_experts=None, cache: CacheSetting | None = None, in_place: bool = True, **opts) -> None:
        options = RouterOptions(model=str(model_dir), dtype=dtype, **opts)
        if sched is not None:
            options = dataclasses.replace(options, sched=sched)

        def local(cfg, device):
            ckpt = Checkpoint(model_dir)
            shard = ExpertShard(cfg, ckpt, 0, 1, getattr(torch, dtype), quantize=options.quantize, device=device,
                                cache=cache, in_place=in_place)
            shard.loaded()
            self.shard = shard
            experts = LocalExperts(shard)
            return experts if wrap_experts is None else wrap_experts(experts)

        self.built: BuiltEngine = build_engine(options, local)
        self.engine = self.built.engine
        self.engine.start()
        self._n = 0

    def submit(self, prompt: list[int], max_tokens: int, **sampling):
        self._n += 1
        return self.engine.submit(Sequence(f"r{self._n}", list(prompt), Sampling(max_tokens=max_tokens, **sampling)))

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
        self.built.close()
        if getattr(self, "shard", None) is not None:
            self.shard.close()

    def __enter__(self) -> InProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
