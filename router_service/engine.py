"""The engine loop: schedule → execute → postprocess, on one thread; requests arrive from gRPC threads."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from router_service.dispatch import WorkerError
from router_service.kv_cache import KVCache
from router_service.metrics import Metrics
from router_service.model import Experts, RouterModel
from router_service.sampler import Sampler
from router_service.scheduler import QueueFull, Scheduled, Scheduler
from router_service.sequence import Sequence
from router_service.step_inputs import SeqSlice, StepInputs

log = logging.getLogger("colibri.router")


@dataclass(frozen=True)
class Tokens:
    token_ids: list[int]
    logits: list[bytes]


@dataclass(frozen=True)
class Done:
    reason: str            # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float


@dataclass(frozen=True)
class Failed:
    message: str


Event = Tokens | Done | Failed


class Engine:
    def __init__(self, model: RouterModel, kv: KVCache, scheduler: Scheduler, experts: Experts,
                 eos_token_ids: tuple[int, ...], micro_batches: int = 1) -> None:
        self.model, self.kv, self.scheduler, self.experts = model, kv, scheduler, experts
        self.micro_batches = micro_batches
        self.metrics = Metrics()
        self.phase = {"schedule": 0.0, "prepare": 0.0, "forward": 0.0, "postprocess": 0.0}  # seconds
        self.metrics.gauges.update({
            "kv_cache_blocks_total": scheduler.alloc.num_blocks, "kv_cache_blocks_free": scheduler.alloc.num_free,
            "num_requests_running": 0, "num_requests_waiting": 0})
        self.eos = set(eos_token_ids)
        self.sampler = Sampler()
        self.outputs: dict[str, queue.SimpleQueue[Event]] = {}
        self.seqs: dict[str, Sequence] = {}
        self._cv = threading.Condition()
        self._aborts: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop stepping; every request still open gets an error instead of waiting forever."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)
        with self._cv:
            for seq in list(self.seqs.values()):
                self._fail(seq, "the router is shutting down; retry on another replica")

    # -- called from gRPC threads ---------------------------------------------------------------
    def submit(self, seq: Sequence) -> queue.SimpleQueue[Event]:
        """Raises QueueFull when the waiting queue is at its bound."""
        with self._cv:
            if seq.request_id in self.seqs:
                raise ValueError(f"request_id '{seq.request_id}' is already running; use a unique id")
            try:
                self.scheduler.add(seq)
            except QueueFull:
                with self.metrics.lock:
                    self.metrics.rejected += 1
                raise
            with self.metrics.lock:
                self.metrics.prompt_tokens += len(seq.prompt_ids)
            q: queue.SimpleQueue[Event] = queue.SimpleQueue()
            self.outputs[seq.request_id] = q
            self.seqs[seq.request_id] = seq
            self._cv.notify()
        return q

    def abort(self, request_id: str) -> bool:
        with self._cv:
            found = request_id in self.seqs
            if found:
                self._aborts.append(request_id)
                self._cv.notify()
        return found

    # -- engine thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not self._aborts and not self.scheduler.has_work():
                    self._cv.wait()
                if self._stop:
                    return
                for rid in self._aborts:
                    if rid in self.seqs:
                        self._finish(self.seqs[rid], "abort")
                self._aborts.clear()
                t_sched = time.perf_counter()
                batch = self.scheduler.schedule()
                self.phase["schedule"] += time.perf_counter() - t_sched
            if not batch:
                time.sleep(0.001)
                continue
            t0 = time.perf_counter()
            try:
                logits = self._execute(batch)
                with self._cv:
                    t_post = time.perf_counter()
                    self._postprocess(batch, logits)
                    self.phase["postprocess"] += time.perf_counter() - t_post
                    self._update_metrics(batch, time.perf_counter() - t0)
            except WorkerError as exc:  # a worker died: fail this batch with its message, keep serving
                log.error("step %d failed: %s", self.metrics.steps, exc)
                self._fail_batch(batch, str(exc))
                continue
            except Exception as exc:  # a bug must not hang every client: log it whole, fail the batch
                log.exception("step %d failed", self.metrics.steps)
                self._fail_batch(batch, f"internal error in the engine step: {exc!r}")
                continue

    def _execute(self, batch: list[Scheduled]) -> torch.Tensor:
        """Split the batch into micro-batches (decodes stay first in each) and run them ping-pong."""
        t_prep = time.perf_counter()
        n = min(self.micro_batches, len(batch))
        bounds = [len(batch) * j // n for j in range(n + 1)]
        steps = []
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            slices, tokens = [], []
            for s in batch[lo:hi]:
                seq = s.seq
                slices.append(SeqSlice(seq.num_cached, s.num_new, seq.block_table, s.samples))
                tokens.extend(seq.token(i) for i in range(seq.num_cached, seq.num_cached + s.num_new))
            steps.append(StepInputs.build(slices, tokens, self.kv.block_size))
        self.phase["prepare"] += time.perf_counter() - t_prep
        t0 = time.perf_counter()
        logits = self.model.forward(steps, self.kv, self.experts)            # [B, V]
        self.phase["forward"] += time.perf_counter() - t0
        return logits

    def _postprocess(self, batch: list[Scheduled], logits: torch.Tensor) -> None:
        sampled = [s for s in batch if s.samples]
        for s in batch:
            s.seq.num_cached += s.num_new
        live = [(i, s.seq) for i, s in enumerate(sampled) if s.seq.request_id in self.seqs]
        tokens = self.sampler.sample(logits, [(seq.request_id, seq.sampling) for _, seq in live]) if live else []
        now = time.monotonic()
        for (row, seq), tok in zip(live, tokens, strict=True):
            seq.output_ids.append(tok)
            if seq.first_token_at is None:
                seq.first_token_at = now
            raw = [logits[row].numpy().tobytes()] if seq.sampling.return_logits else []
            self.outputs[seq.request_id].put(Tokens([tok], raw))
            sp = seq.sampling
            if tok in sp.stop_token_ids or (not sp.ignore_eos and tok in self.eos):
                self._finish(seq, "stop")
            elif len(seq.output_ids) >= sp.max_tokens or seq.num_tokens >= self.scheduler.cfg.max_model_len:
                self._finish(seq, "length")

    def _update_metrics(self, batch: list[Scheduled], seconds: float) -> None:
        m, sch = self.metrics, self.scheduler
        with m.lock:
            m.steps += 1
            m.step_seconds += seconds
            m.generation_tokens += sum(1 for s in batch if s.samples)
            m.gauges.update({
                "num_requests_running": len(sch.running), "num_requests_waiting": len(sch.waiting),
                "kv_cache_blocks_total": sch.alloc.num_blocks, "kv_cache_blocks_free": sch.alloc.num_free,
                "kv_cache_usage_ratio": 1 - sch.alloc.num_free / sch.alloc.num_blocks,
                "batch_size": len(batch), "batch_tokens": sum(s.num_new for s in batch),
            })
            m.phases = dict(self.phase, **getattr(self.experts, "timers", {}))
            m.gauges["batch_tokens_max"] = max(m.gauges.get("batch_tokens_max", 0), m.gauges["batch_tokens"])

    def _finish(self, seq: Sequence, reason: str) -> None:
        ttft = (seq.first_token_at - seq.arrival) * 1e3 if seq.first_token_at else 0.0
        self._retire(seq, reason, Done(reason, len(seq.prompt_ids), len(seq.output_ids), ttft))

    def _fail_batch(self, batch: list[Scheduled], message: str) -> None:
        with self._cv:
            for s in batch:
                self._fail(s.seq, message)

    def _fail(self, seq: Sequence, message: str) -> None:
        if seq.request_id in self.seqs:
            self._retire(seq, "error", Failed(message))

    def _retire(self, seq: Sequence, reason: str, last: Event) -> None:
        """The one way out of the engine: free the KV blocks, count it, send the last event, forget it."""
        self.scheduler.finish(seq, reason)
        with self.metrics.lock:
            self.metrics.requests[reason] += 1
            self.metrics.gauges["kv_cache_blocks_free"] = self.scheduler.alloc.num_free
            self.metrics.gauges["num_requests_running"] = len(self.scheduler.running)
        self.outputs.pop(seq.request_id).put(last)
        del self.seqs[seq.request_id]
        self.sampler.forget(seq.request_id)
