"""The engine thread's side of the engine: each step is schedule → execute → postprocess, and every sequence
leaves through one `_retire`. `Engine` (engine.py) holds the state declared here and adds the calls of the gRPC
threads (submit, abort, cancel, drain, stop).

Shapes: B sequences that sample this step, V vocabulary.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

import torch

from colibri_common.device import device_scope
from colibri_common.file_watch import MappingChanged
from colibri_common.repeated_log import RepeatedLog
from router_service.engine.batch import Step
from router_service.engine.events import Event, Failed, FailureCode, Finished, Outputs, Tokens
from router_service.engine.metrics import Metrics
from router_service.engine.outbox import HOLD_FROM, Outbox
from router_service.engine.sampler import SampleError, Sampler
from router_service.engine.scheduler import Scheduler
from router_service.engine.sequence import FinishReason, Sequence
from router_service.engine.step_stats import PreemptionWarning, occupancy, record_step
from router_service.model.decode_graphs import DecodeGraphs
from router_service.model.kv_cache import KVCache
from router_service.model.model import RouterModel
from router_service.model.step_inputs import SeqSlice, StepInputs
from router_service.moe.experts import Experts, ExpertsUnavailable
from router_service.moe.transport import WorkerError

log = logging.getLogger("colibri.router")


class StepLoop:
    # the engine's state (set by Engine.__init__), read and changed here under `_cv` where gRPC threads share it
    model: RouterModel
    kv: KVCache
    scheduler: Scheduler
    experts: Experts
    micro_batches: int
    window: int                              # sliding layers' masks (0: none)
    metrics: Metrics
    graphs: DecodeGraphs | None
    on_damage: Callable[[str], None] | None
    on_stopped: Callable[[str], None] | None
    phase: dict[str, float]                  # seconds by phase: schedule, prepare, forward, postprocess
    eos: frozenset[int]
    sampler: Sampler
    outputs: dict[int, Outputs]              # by Sequence.uid (a request's choices share one)
    seqs: dict[int, Sequence]
    by_request_id: dict[str, list[Sequence]]
    _forks: dict[int, list[Sequence]]
    _outbox: Outbox
    _cv: threading.Condition
    _aborts: list[tuple[int, FinishReason]]
    _failures: RepeatedLog
    _preemptions: PreemptionWarning
    _stop: bool
    stopped: str | None

    def _loop(self) -> None:
        try:
            with device_scope(self.model.device):      # CUDA's current device is per thread
                self._steps()
        except BaseException as exc:                   # a bug outside a step (scheduling, aborts): no client waits
            log.exception("the engine thread stopped on an error outside a step; failing every open request")
            why = f"the engine stopped on an internal error ({exc!r}); retry on another replica"
            self._outbox.flush()                       # what the steps before it sent comes first
            with self._cv:
                self.stopped = why
                self._stop = True
                for seq in list(self.seqs.values()):
                    try:
                        self._fail(seq, FailureCode.INTERNAL, why)
                    except Exception:                  # noqa: BLE001 (its bookkeeping is what broke: still tell it)
                        self.seqs.pop(seq.uid, None)
                        q = self.outputs.pop(seq.uid, None)
                        if q is not None:
                            self._outbox.put(q, Failed(FailureCode.INTERNAL, why, seq.index))
            self._outbox.flush()
            if self.on_stopped is not None:           # a router without its engine serves nothing: it stops, to
                self.on_stopped(why)                  # be restarted (readiness alone left it up, unready, for good)

    def _steps(self) -> None:
        while (step := self._schedule()) is not None:
            if not step.micro_batches:
                self._outbox.flush()
                with self.metrics.lock:    # what the engine holds, while it cannot step (dashboards, KEDA)
                    self.metrics.gauges.update(occupancy(self.scheduler), batch_size=0, batch_tokens=0)
                time.sleep(0.001)     # work is waiting but nothing fits yet (KV cache full)
                continue
            t0 = time.perf_counter()
            try:
                logits = self._execute(step)                                 # [B, V]
                with self._cv:
                    self._postprocess(step, logits)
                    self._update_metrics(step, time.perf_counter() - t0)
                if self._failures.reason:           # a step went through: the incident is over
                    self._failures.end()
            except MappingChanged as exc:       # weights read in place changed: no step may run again
                self._damaged(str(exc))
                return
            except ExpertsUnavailable as exc:   # no live worker for some tokens' experts: fail those requests
                self._fail_unserved(step, exc)
            except WorkerError as exc:   # a worker failed: fail this step's requests, keep serving
                self._failures.say(_incident(exc), f"step {self.metrics.steps} failed: {exc}")
                code = FailureCode.UNAVAILABLE if exc.retryable else FailureCode.INTERNAL
                self._fail_step(step, code, str(exc))
            except Exception as exc:     # a bug: log it whole, fail the step's requests (not retryable), go on
                log.exception("step %d failed", self.metrics.steps)
                self._fail_step(step, FailureCode.INTERNAL, f"internal error in the engine step: {exc!r}")

    def _damaged(self, why: str) -> None:
        """The checkpoint bytes the model reads in place changed under it (a read could fault): every open request
        ends UNAVAILABLE (retryable), the engine stops, and `on_damage` stops the service (a restart maps afresh)."""
        message = f"{why}; the router stops to map it afresh: retry"
        log.error("%s: the engine stops", why)
        with self._cv:
            self.stopped = message
            self._stop = True
            for seq in list(self.seqs.values()):
                self._fail(seq, FailureCode.UNAVAILABLE, message)
        self._outbox.flush()
        if self.on_damage is not None:
            self.on_damage(why)

    def _schedule(self) -> Step | None:
        """Wait for work, apply aborts, pick this step's batch; None when the engine stops."""
        with self._cv:
            while not self._stop and not self._aborts and not self.scheduler.has_work():
                self._outbox.flush()                   # idle: the last step's events go now
                if self.metrics.gauges.get("batch_size"):
                    with self.metrics.lock:            # an idle engine's batch is empty (it read the last step's)
                        self.metrics.gauges.update(batch_size=0, batch_tokens=0)
                self._cv.wait()
            if self._stop:
                self._outbox.flush()
                return None
            for uid, reason in self._aborts:
                if uid in self.seqs:
                    self._finish(self.seqs[uid], reason)
            self._aborts.clear()
            t0 = time.perf_counter()
            step = Step.split(self.scheduler.schedule(), self.micro_batches)
            self.phase["schedule"] += time.perf_counter() - t0
        now = time.monotonic()
        for s in step.scheduled:
            if s.seq.scheduled_at is None:
                s.seq.scheduled_at = now
        return step

    def _execute(self, step: Step) -> torch.Tensor:
        """The model over every micro-batch (ping-pong when there are several): logits [B, V] float32."""
        t0 = time.perf_counter()
        batches = []
        for mb in step.micro_batches:
            slices, tokens = [], []
            for s in mb:
                seq = s.seq
                slices.append(SeqSlice(seq.num_cached, s.num_new, seq.block_table, s.samples))
                tokens.extend(seq.token(i) for i in range(seq.num_cached, seq.num_cached + s.num_new))
            batches.append((slices, tokens))
        graphs = self.graphs
        # the last step's events go out while this step waits on its workers (outbox.py), or when it ends
        flush = self._outbox.flush
        try:
            if graphs is not None and len(batches) == 1 and graphs.fits(batches[0][0]):
                t1 = time.perf_counter()
                with self.experts.stepping(flush):
                    logits = graphs.run(*batches[0])                          # [B, V] a CUDA graph replayed
            else:
                inputs = [StepInputs.build(slices, tokens, self.kv.block_size, self.window)
                          for slices, tokens in batches]
                t1 = time.perf_counter()
                with self.experts.stepping(flush):                            # placement switches between steps
                    logits = self.model.forward(inputs, self.kv, self.experts)   # [B, V]
        finally:
            flush()                                    # a failed step too: what it held goes before its failures
        self.phase["prepare"] += t1 - t0
        self.phase["forward"] += time.perf_counter() - t1
        return logits

    def _postprocess(self, step: Step, logits: torch.Tensor) -> None:
        """Sample the live sequences' rows, stream their tokens, finish those that stop."""
        t0 = time.perf_counter()
        assert logits.shape[0] == len(step.sampled), (logits.shape, len(step.sampled))  # row i: step.sampled[i]
        if self.model.last_routing:
            self._remember_routing(step)
        step.advance()
        live = [(row, seq) for row, seq in enumerate(step.sampled) if self.seqs.get(seq.uid) is seq]
        if live:
            rows = logits if len(live) == len(step.sampled) else logits[[row for row, _ in live]]  # [b, V]
            sampled = self.sampler.sample(rows, [seq for _, seq in live])
            now = time.monotonic()
            for (row, seq), out in zip(live, sampled, strict=True):
                if isinstance(out, SampleError):        # this sequence's logits or sampling failed: it alone ends
                    log.error("request %s: %s", seq.request_id, out)
                    self._fail(seq, FailureCode.INTERNAL, str(out))
                    continue
                if seq.uid in self._forks:               # its prompt is cached: the other choices share it now
                    self._fork(seq)
                tok = out.token
                if seq.first_token_at is None:
                    seq.first_token_at = now
                    self.metrics.ttft.observe(now - seq.arrival)
                else:
                    self.metrics.itl.observe(now - seq.last_token_at)
                seq.last_token_at = now
                raw = [logits[row].cpu().numpy().tobytes()] if seq.sampling.return_logits else []
                lps = (out,) if seq.sampling.wants_logprobs else ()
                reason = seq.append_token(tok, self.eos, self.scheduler.cfg.max_model_len)
                q = self.outputs[seq.uid]
                self._outbox.put(q, Tokens([tok], raw, seq.index, lps, stop_token=reason is FinishReason.STOP))
                if q.pause_if_full():                    # its reader is behind: no more steps until it reads
                    for member in self.by_request_id.get(seq.request_id, ()):
                        if self.outputs.get(member.uid) is q:    # (not a new request that took a cancelled id)
                            member.paused = True
                if reason is not None:
                    self._finish(seq, reason)
        if len(self._outbox) < HOLD_FROM:    # a few handlers go at once, beside the engine's own Python (outbox.py)
            self._outbox.flush()
        self.phase["postprocess"] += time.perf_counter() - t0

    def _fork(self, first: Sequence) -> None:
        """`first` has its prompt cached: its other choices take its full prompt blocks and queue for the rest."""
        shared = (len(first.prompt_ids) - 1) // self.kv.block_size
        for seq in self._forks.pop(first.uid):
            if self.seqs.get(seq.uid) is not seq:       # aborted while it waited
                continue
            seq.block_table = self.scheduler.share_blocks(first.block_table[:shared])
            seq.num_cached = shared * self.kv.block_size
            self.scheduler.add_fork(seq)
            with self.metrics.lock:
                self.metrics.kv_blocks_shared += shared

    def _remember_routing(self, step: Step) -> None:
        """Each scheduled sequence's experts at its last row of this step, as layer·E + e (torch-free after)."""
        E = self.model.cfg.num_experts
        for mb, ids in zip(step.micro_batches, self.model.last_routing, strict=True):
            last, row = [], -1
            for s in mb:
                row += s.num_new
                last.append(row)
            per_layer = torch.stack(ids)[:, last].permute(1, 0, 2).tolist()       # [B, L_moe, K]
            for s, layers in zip(mb, per_layer, strict=True):
                s.seq.experts = frozenset(j * E + e for j, es in zip(self.model.moe_layers, layers,
                                                                       strict=True) for e in es)


    def _update_metrics(self, step: Step, seconds: float) -> None:
        counters = {"micro_batch_overlaps": self.model.overlaps, "prefetch_predicted": self.model.predicted,
                    "prefetch_right": self.model.predicted_right,
                    "graph_replays": self.graphs.replays if self.graphs is not None else 0}
        record_step(self.metrics, step, seconds, self.scheduler, counters, dict(self.phase, **self.experts.timers))
        self._preemptions.say(self.scheduler, self.kv.block_size)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        ttft = (seq.first_token_at - seq.arrival) * 1e3 if seq.first_token_at else 0.0
        self._retire(seq, reason, Finished(reason, len(seq.prompt_ids), len(seq.output_ids), ttft, seq.index))

    def _fail_unserved(self, step: Step, exc: ExpertsUnavailable) -> None:
        """Fail the requests whose tokens needed the missing experts; the others are not advanced, so the
        next step runs theirs again (identical tokens: their KV slots are rewritten with the same values)."""
        rows = set(exc.rows.tolist())
        hit, row = [], 0
        for s in step.micro_batches[exc.micro_batch]:
            if rows & set(range(row, row + s.num_new)):
                hit.append(s.seq)
            row += s.num_new
        self._failures.say(_incident(exc), f"step {self.metrics.steps}: {exc}; failing {len(hit)} of "
                                           f"{len(step.scheduled)} requests")
        with self._cv:
            for seq in hit or [s.seq for s in step.scheduled]:
                self._fail(seq, FailureCode.UNAVAILABLE, str(exc))

    def _fail_step(self, step: Step, code: FailureCode, message: str) -> None:
        with self._cv:
            for s in step.scheduled:
                self._fail(s.seq, code, message)

    def _fail(self, seq: Sequence, code: FailureCode, message: str) -> None:
        if self.seqs.get(seq.uid) is seq:
            self._retire(seq, FinishReason.ERROR, Failed(code, message, seq.index))

    def _retire(self, seq: Sequence, reason: FinishReason, last: Event) -> None:
        """The one way out of the engine: free the KV blocks, count it, send the last event, forget it."""
        self.scheduler.finish(seq)
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.metrics.finished(seq, time.monotonic())
        with self.metrics.lock:
            self.metrics.requests[reason.value] += 1
            self.metrics.gauges.update(occupancy(self.scheduler))
        self._outbox.put(self.outputs.pop(seq.uid), last)
        del self.seqs[seq.uid]
        group = self.by_request_id.get(seq.request_id)
        if group is not None and seq in group:
            group.remove(seq)
            if not group:
                del self.by_request_id[seq.request_id]
        self.sampler.forget(seq.uid)
        for waiting in self._forks.pop(seq.uid, ()):   # its choices that never got its prompt end as it did
            if isinstance(last, Failed):
                self._fail(waiting, last.code, last.message)
            else:
                self._finish(waiting, reason)
        self._cv.notify_all()                     # a drain waits for the last one


def _incident(exc: Exception) -> str:
    """What makes failures one incident in the log: their text without the layer (each layer of a step says its
    own)."""
    return re.sub(r"layer \d+", "layer N", str(exc))

