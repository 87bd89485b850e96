"""What the engine tells its metrics: the gauges of what it holds, each step's counters, and the preemption warning.

Torch-free: it reads the scheduler's bookkeeping and counters the model and the experts client keep.
"""

from __future__ import annotations

import logging
import time

from router_service.engine.batch import Step
from router_service.engine.metrics import Metrics
from router_service.engine.scheduler import Scheduler

log = logging.getLogger("colibri.router")
PREEMPTIONS_EVERY_S = 30.0


def occupancy(scheduler: Scheduler) -> dict[str, float]:
    """The gauges of what the engine holds (KV blocks, requests), the same wherever they are refreshed: at start,
    after each step and when a request leaves (a cancel or an abort between steps included)."""
    total, free = scheduler.kv_blocks()
    paused = sum(s.paused for s in scheduler.running)
    return {"kv_cache_blocks_total": total, "kv_cache_blocks_free": free, "kv_cache_usage_perc": 1 - free / total,
            "num_requests_running": len(scheduler.running) - paused, "num_requests_paused": paused,
            "num_requests_waiting": len(scheduler.waiting)}


def record_step(m: Metrics, step: Step, seconds: float, scheduler: Scheduler, counters: dict[str, int],
                phases: dict[str, float]) -> None:
    """One step's counters and gauges. `counters`: the model's and the graphs' running totals (micro-batch
    overlaps, prefetch predicted / right, CUDA graph replays); `phases`: seconds by engine phase."""
    batch = step.scheduled
    tokens = sum(s.num_new for s in batch)
    with m.lock:
        m.steps += 1
        m.step_seconds += seconds
        m.generation_tokens += len(step.sampled)
        m.preemptions = scheduler.num_preemptions
        m.micro_batch_overlaps = counters["micro_batch_overlaps"]
        m.prefetch_predicted, m.prefetch_right = counters["prefetch_predicted"], counters["prefetch_right"]
        m.graph_replays = counters["graph_replays"]
        m.gauges.update(occupancy(scheduler), batch_size=len(batch), batch_tokens=tokens)
        m.phases = phases
        for name in ("batch_size", "batch_tokens"):
            m.gauges[name + "_max"] = max(m.gauges.get(name + "_max", 0), m.gauges[name])
    m.iteration_tokens.observe(tokens)


class PreemptionWarning:
    """Preemptions cost a recompute from the prompt each: a WARNING with the count and what to change, at most
    every PREEMPTIONS_EVERY_S while they go on (vLLM's operators know the line), never one per preemption."""

    def __init__(self) -> None:
        self._said = (0, -PREEMPTIONS_EVERY_S)          # (count, monotonic time) when last logged

    def say(self, scheduler: Scheduler, block_size: int) -> None:
        count, said_at = self._said
        now = time.monotonic()
        total = scheduler.num_preemptions
        if total > count and now - said_at >= PREEMPTIONS_EVERY_S:
            blocks, _ = scheduler.kv_blocks()
            log.warning("%d sequence%s preempted for KV cache space (%d since start): each is recomputed from its "
                        "prompt, which costs throughput; the KV cache holds %d blocks of %d tokens: raise "
                        "--kv-cache-mb or lower --max-batch-size", total - count, "s" * (total - count > 1), total,
                        blocks, block_size)
            self._said = (total, now)
