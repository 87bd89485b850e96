"""The engine: the loop on one thread steps the batch (schedule → execute → postprocess, step_loop.py); requests
arrive from gRPC threads through `submit`, are ended early by `abort` / `cancel`, and leave through one `_retire`."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

from colibri_common.device import device_scope
from colibri_common.errors import DRAINING_MARK
from colibri_common.file_watch import MappingChanged
from colibri_common.repeated_log import RepeatedLog
from router_service.engine.events import FailureCode, Outputs
from router_service.engine.metrics import Metrics
from router_service.engine.outbox import Outbox
from router_service.engine.sampler import Sampler
from router_service.engine.scheduler import QueueFull, Scheduler, SchedulerConfig
from router_service.engine.sequence import FinishReason, Sequence
from router_service.engine.step_loop import StepLoop
from router_service.engine.step_stats import PreemptionWarning, occupancy
from router_service.model.decode_graphs import DecodeGraphs
from router_service.model.kv_cache import KVCache
from router_service.model.model import RouterModel
from router_service.moe.experts import Experts

log = logging.getLogger("colibri.router")


class Draining(Exception):
    """The router is shutting down: new requests go to another replica (UNAVAILABLE)."""


class DuplicateId(Exception):
    """An open request already has this request_id (ALREADY_EXISTS)."""


class Engine(StepLoop):
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
        self.metrics.gauges.update(occupancy(self.scheduler))
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
        self._preemptions = PreemptionWarning()
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
                raise Draining(f"{DRAINING_MARK}; retry on another replica")
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
                self.metrics.gauges.update(occupancy(self.scheduler))  # waiting counts now, not after the next step
            q = Outputs(on_room=lambda: self._resume(group))
            for member in group:
                self.outputs[member.uid] = q
                self.seqs[member.uid] = member
            self.by_request_id[seq.request_id] = list(group)     # its own list: retiring edits it
            self._cv.notify()
        return q

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Requests submitted inside the block are all waiting before the next step is scheduled (a step under way
        runs on, and waits to post its tokens): the scheduler's admission, not thread timing, decides their batches.
        So a set of prompts given to an idle engine takes the same batches run after run, and the same bits where
        the kernels are not batch-invariant (without `--batch-invariant`, float32 linears batch their rows).
        Collect nothing inside it: the engine is waiting."""
        with self._cv:
            yield

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

