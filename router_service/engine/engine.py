"""The engine loop on one thread: each step is schedule → execute → postprocess; requests arrive from gRPC
threads through `submit` and leave through one `_retire`.

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
from router_service.engine.scheduler import QueueFull, Scheduler, SchedulerConfig
from router_service.engine.sequence import FinishReason, Sequence
from router_service.model.decode_graphs import DecodeGraphs
from router_service.model.kv_cache import KVCache
from router_service.model.model import RouterModel
from router_service.model.step_inputs import SeqSlice, StepInputs
from router_service.moe.experts import Experts, ExpertsUnavailable
from router_service.moe.transport import WorkerError

log = logging.getLogger("colibri.router")
PREEMPTIONS_EVERY_S = 30.0


class Draining(Exception):
    """The router is shutting down: new requests go to another replica (UNAVAILABLE)."""


class DuplicateId(Exception):
    """An open request already has this request_id (ALREADY_EXISTS)."""


class Engine:
    def __init__(self, model: RouterModel, kv: KVCache, scheduler: Scheduler, experts: Experts,
                 eos_token_ids: tuple[int, ...], micro_batches: int = 1) -> None:
        self.model, self.kv, self.scheduler, self.experts = model, kv, scheduler, experts
        self.micro_batches = micro_batches
        self.window = model.cfg.sliding_window if model.cfg.sliding_layers else 0   # sliding layers' masks
        self.metrics = Metrics(sources=[experts])
        self.graphs: DecodeGraphs | None = None     # CUDA graphs of decode steps, where they can be (build.py)
        self.on_damage: Callable[[str], None] | None = None   # told once when the model's mapped weights change
        self.on_stopped: Callable[[str], None] | None = None  # told once if the engine thread dies on an error
        self.phase = {"schedule": 0.0, "prepare": 0.0, "forward": 0.0, "postprocess": 0.0}  # seconds
        self.metrics.gauges.update(self._occupancy())
        self.eos = frozenset(eos_token_ids)
        self.sampler = Sampler(self.eos)
        self.outputs: dict[int, Outputs] = {}     # by Sequence.uid (a request's choices share one)
        self._outbox = Outbox()                   # their events, delivered while the engine waits (outbox.py)
        self.seqs: dict[int, Sequence] = {}
        self.by_request_id: dict[str, list[Sequence]] = {}        # the clients' ids of the open requests
        self._forks: dict[int, list[Sequence]] = {}               # by the first choice's uid: the choices that
                                                                  # share its prompt's blocks once it is cached
        self._cv = threading.Condition()
        self._aborts: list[tuple[int, FinishReason]] = []
        self._failures = RepeatedLog(log)   # a step failed: said once per incident, not once per step
        self._preemptions_said = (0, -PREEMPTIONS_EVERY_S)    # (count, monotonic time) when last logged
        self._stop = False
        self.stopped: str | None = None            # why the engine thread ended on an error, if it did
        self.draining = False
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def drain(self, timeout: float) -> bool:
        """Refuse new requests (UNAVAILABLE) and wait up to `timeout` s for the open ones to finish; True when
        they all did."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self.draining = True
            while self.seqs and time.monotonic() < deadline:
                self._cv.wait(timeout=min(0.1, max(0.0, deadline - time.monotonic())))
        self._outbox.flush()          # the finished requests' last events, before the server stops
        return not self.seqs

    def stop(self) -> None:
        """Stop stepping; every request still open gets an error instead of waiting forever."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)
        with self._cv:
            for seq in list(self.seqs.values()):
                self._fail(seq, FailureCode.UNAVAILABLE, "the router is shutting down; retry on another replica")
        self._outbox.flush()

    # -- called from gRPC threads ---------------------------------------------------------------
    @property
    def limits(self) -> SchedulerConfig:
        """What the engine takes: batch size, tokens a step, waiting requests, the model's length."""
        return self.scheduler.cfg

    def submit(self, choices: Sequence | list[Sequence]) -> Outputs:
        """One request: one sequence, or its n choices (same request_id and prompt, `index` 0..n-1). The first
        choice prefills the prompt; the others then share its full blocks and compute only the rest.

        Raises QueueFull when the waiting queue is at its bound, Draining when the router is shutting down,
        DuplicateId when an open request has this request_id, NeverFits (a ValueError) for a request the
        whole KV cache cannot hold."""
        group = choices if isinstance(choices, list) else [choices]
        seq = group[0]
        if self.model.track_routing and not seq.experts and not self.draining and self.stopped is None:
            seq.experts = self._likely_experts(seq)                       # routing-aware batching
            for other in group[1:]:
                other.experts = seq.experts
        shared = (len(seq.prompt_ids) - 1) // self.kv.block_size   # full prompt blocks; >= 1 token left to run
        with self._cv:
            if self.stopped is not None:
                raise Draining(self.stopped)
            if self.draining or self._stop:
                raise Draining("the router is shutting down (draining); retry on another replica")
            if seq.request_id in self.by_request_id:
                raise DuplicateId(f"request_id '{seq.request_id}' belongs to a request still open; use a "
                                  f"unique id (or leave it empty and the router makes one)")
            try:
                self.scheduler.add(seq, siblings=len(group) - 1)
            except QueueFull:
                with self.metrics.lock:
                    self.metrics.rejected += 1
                raise
            if len(group) > 1:
                if shared:
                    self._forks[seq.uid] = group[1:]
                else:                                  # a prompt within one block: nothing to share
                    for other in group[1:]:
                        self.scheduler.add_fork(other, first=False)
            with self.metrics.lock:
                self.metrics.prompt_tokens += len(seq.prompt_ids) * len(group)
                self.metrics.gauges.update(self._occupancy())     # waiting counts now, not after the next step
            q = Outputs(on_room=lambda: self._resume(group))
            for member in group:
                self.outputs[member.uid] = q
                self.seqs[member.uid] = member
            self.by_request_id[seq.request_id] = list(group)     # its own list: retiring edits it
            self._cv.notify()
        return q

    def _resume(self, group: list[Sequence]) -> None:
        """A paused request's reader caught up: its sequences take steps again."""
        with self._cv:
            for seq in group:
                seq.paused = False
            self._cv.notify()

    def _likely_experts(self, seq: Sequence) -> frozenset[int]:
        """A new prompt's likely experts (its gates on its embeddings); none if that fails: it is only a hint."""
        try:
            with device_scope(self.model.device):
                return self.model.predict_experts(seq.prompt_ids)
        except MappingChanged:           # the embedding's file changed: no hint (the next step fails the request)
            return frozenset()
        except Exception:  # noqa: BLE001 (admission goes on without the hint)
            log.exception("request %s: predicting its experts failed; admitted without them", seq.request_id)
            return frozenset()

    def abort(self, request_id: str) -> bool:
        """The client-facing Abort: every choice of the open request with this id, if any."""
        with self._cv:
            group = list(self.by_request_id.get(request_id, ()))
        return any([self.cancel(seq) for seq in group])

    def cancel(self, seq: Sequence, reason: FinishReason = FinishReason.ABORT) -> bool:
        """End this very sequence before the next step (its client went away: ABORT; a stop string the handler
        found in its text: STOP): by the engine's own id, never by request_id."""
        with self._cv:
            found = seq.uid in self.seqs
            if found:
                self._aborts.append((seq.uid, reason))
                group = self.by_request_id.get(seq.request_id)
                if group is not None and seq in group:    # its id is free once every choice is leaving: a client
                    group.remove(seq)                     # that cancelled may send it again before the next step
                    if not group:
                        del self.by_request_id[seq.request_id]
                self._cv.notify()
        return found

    # -- engine thread ----------------------------------------------------------------------------
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
                    self.metrics.gauges.update(self._occupancy())
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

    def _occupancy(self) -> dict[str, float]:
        """The gauges of what the engine holds (KV blocks, requests), the same wherever they are refreshed: at
        start, after each step and when a request leaves (a cancel or an abort between steps included)."""
        total, free = self.scheduler.kv_blocks()
        paused = sum(s.paused for s in self.scheduler.running)
        return {"kv_cache_blocks_total": total, "kv_cache_blocks_free": free, "kv_cache_usage_perc": 1 - free / total,
                "num_requests_running": len(self.scheduler.running) - paused, "num_requests_paused": paused,
                "num_requests_waiting": len(self.scheduler.waiting)}

    def _update_metrics(self, step: Step, seconds: float) -> None:
        m, sch, batch = self.metrics, self.scheduler, step.scheduled
        tokens = sum(s.num_new for s in batch)
        with m.lock:
            m.steps += 1
            m.step_seconds += seconds
            m.generation_tokens += len(step.sampled)
            m.preemptions = sch.num_preemptions
            m.micro_batch_overlaps = self.model.overlaps
            m.prefetch_predicted, m.prefetch_right = self.model.predicted, self.model.predicted_right
            m.graph_replays = self.graphs.replays if self.graphs is not None else 0
            m.gauges.update(self._occupancy(), batch_size=len(batch), batch_tokens=tokens)
            m.phases = dict(self.phase, **self.experts.timers)
            for name in ("batch_size", "batch_tokens"):
                m.gauges[name + "_max"] = max(m.gauges.get(name + "_max", 0), m.gauges[name])
        m.iteration_tokens.observe(tokens)
        self._say_preemptions()

    def _say_preemptions(self) -> None:
        """Preemptions cost a recompute from the prompt each: a WARNING with the count and what to change, at most
        every PREEMPTIONS_EVERY_S while they go on (vLLM's operators know the line), never one per preemption."""
        count, said_at = self._preemptions_said
        now = time.monotonic()
        total = self.scheduler.num_preemptions
        if total > count and now - said_at >= PREEMPTIONS_EVERY_S:
            blocks, _ = self.scheduler.kv_blocks()
            log.warning("%d sequence%s preempted for KV cache space (%d since start): each is recomputed from its "
                        "prompt, which costs throughput; the KV cache holds %d blocks of %d tokens: raise "
                        "--kv-cache-mb or lower --max-batch-size", total - count, "s" * (total - count > 1), total,
                        blocks, self.kv.block_size)
            self._preemptions_said = (total, now)

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
            self.metrics.gauges.update(self._occupancy())
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
