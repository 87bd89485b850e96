"""Continuous batching: requests join and leave the running batch between steps. Plain Python, no torch.

Each step: running sequences decode one token each (decodes first), then waiting sequences are admitted
FIFO with (chunked) prefill while the token budget and batch size allow. When the KV cache is full, the
newest running sequence is preempted (its blocks freed, recomputed later).

Routing-aware batching (`--routing-aware-batching`): when more requests wait than fit, the next one
admitted is the one whose recent experts (`Sequence.experts`, kept by the engine) overlap the running
batch's most, so a batch shares experts and a bounded expert cache hits. A request passed over (a
younger one admitted while it waits) in `max_passed_over` rounds of admission goes next whatever its
experts, so none starves; a preempted one goes first. Only the `SCAN` oldest waiting requests are
scored, so an admission costs O(SCAN · |experts|).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

from colibri_common.flags import option
from router_service.engine.block_allocator import BlockAllocator, OutOfBlocks
from router_service.engine.sequence import Sequence, Status

SCAN = 64        # routing-aware batching looks at this many of the oldest waiting requests per admission


class QueueFull(Exception):
    """The waiting queue is at its bound: retry later (RESOURCE_EXHAUSTED)."""


class NeverFits(ValueError):
    """The request needs more KV blocks than the whole cache has: it can never run (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int = option(64, "sequences in one step")
    max_num_tokens: int = option(512, "tokens (prefill + decode) in one step; longer prompts prefill in chunks")
    max_waiting: int = option(256, "bounded waiting queue; beyond it RESOURCE_EXHAUSTED")
    max_model_len: int = option(4096, "prompt + output tokens of one request (capped by the model's own limit)")
    routing_aware_batching: bool = option(False, "admit first the waiting requests whose recent experts overlap "
                                                 "the running batch's (a bounded expert cache hits more)")
    max_passed_over: int = option(8, "routing-aware batching: admission rounds in which a request may be passed "
                                     "over by younger ones before it goes next")

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_num_tokens", "max_waiting", "max_model_len", "max_passed_over"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True)
class Scheduled:
    seq: Sequence
    num_new: int

    @property
    def samples(self) -> bool:
        return self.seq.num_cached + self.num_new == self.seq.num_tokens


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: BlockAllocator) -> None:
        self.cfg = cfg
        self.alloc = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._preempted_now: set[int] = set()        # uids preempted in the step being scheduled

    def kv_blocks(self) -> tuple[int, int]:
        """(total, free) KV cache blocks."""
        return self.alloc.num_blocks, self.alloc.num_free

    def share_blocks(self, table: list[int]) -> list[int]:
        """Another reference to these blocks: a parallel-sampling sibling takes its first's prompt blocks."""
        return self.alloc.share(table)

    def add(self, seq: Sequence, siblings: int = 0) -> None:
        """Queue a new request; `siblings` more of its choices will join later (`add_fork`), counted now."""
        if 1 + siblings > self.cfg.max_waiting:          # not even into an empty queue: no retry can help
            raise NeverFits(f"n = {1 + siblings} choices exceed the waiting queue's bound ({self.cfg.max_waiting} "
                            f"sequences); lower n or raise --max-waiting")
        if len(self.waiting) + siblings >= self.cfg.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.cfg.max_waiting} requests); retry later or "
                            f"raise --max-waiting")
        if self.alloc.blocks_for(seq.num_tokens + seq.sampling.max_tokens) > self.alloc.num_blocks:
            raise NeverFits(f"prompt + max_tokens = {seq.num_tokens + seq.sampling.max_tokens} tokens exceeds the "
                            f"whole KV cache ({self.alloc.num_blocks * self.alloc.block_size} tokens); lower "
                            f"max_tokens or shorten the prompt")
        self.waiting.append(seq)

    def add_fork(self, seq: Sequence, first: bool = True) -> None:
        """Queue a choice of a request already admitted: at the head once it shares its first choice's prompt
        blocks (that request is running), else at the tail like any new request. Counted by `add`."""
        if first:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        self.alloc.release(seq.block_table)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        """Whether a step has anything to run: sequences, waiting or running, not paused by their reader."""
        return any(not s.paused for s in self.waiting) or any(not s.paused for s in self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.alloc.release(seq.block_table)
        seq.num_cached, seq.status = 0, Status.WAITING
        seq.passed_over = self.cfg.max_passed_over          # it was running: it goes back first
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _admissible(self, seq: Sequence) -> bool:
        """Not paused by its reader, and not preempted in this very step (taken back at once, a prefill in chunks
        that cannot grow would start over every step)."""
        return not seq.paused and seq.uid not in self._preempted_now

    def _oldest(self) -> int:
        """The index in `waiting` of the oldest admissible sequence (-1: none)."""
        return next((i for i, s in enumerate(self.waiting) if self._admissible(s)), -1)

    def _next_waiting(self, batch: set[int]) -> int:
        """The index in `waiting` of the request to admit next (never one paused by its reader): FIFO, or with
        routing-aware batching the first one passed over too often, else the largest share of its experts already
        in the batch (the oldest among equals)."""
        oldest = self._oldest()
        if not self.cfg.routing_aware_batching or oldest < 0 or len(self.waiting) == 1:
            return oldest
        best, best_share = oldest, -1.0
        for i, seq in enumerate(itertools.islice(self.waiting, SCAN)):
            if not self._admissible(seq):
                continue
            if seq.passed_over >= self.cfg.max_passed_over:
                return i
            share = len(seq.experts & batch) / len(seq.experts) if seq.experts else 0.0
            if share > best_share:
                best, best_share = i, share
        return best

    def _reclaim(self) -> bool:
        """KV blocks back from sequences that take no step: first those paused by a reader that is behind (back to
        waiting, admitted once it reads), then the other choices of a request waiting with their first choice's
        prompt blocks. They recompute later, as a preempted sequence does. Whether any block came free. Before,
        they kept their blocks while the running ones could not grow: an n > 1 request with a long prompt on a
        small cache hung the engine for good, and a prompt prefilled in chunks preempted itself every step and was
        taken back at once (a livelock at full CPU)."""
        before = self.alloc.num_free
        for seq in [s for s in self.running if s.paused and s.block_table]:
            self._preempt(seq)
        if self.alloc.num_free > before:
            return True
        for seq in self.waiting:
            if seq.block_table:
                self.alloc.release(seq.block_table)
                seq.num_cached = 0
                self.num_preemptions += 1
        return self.alloc.num_free > before

    def schedule(self) -> list[Scheduled]:
        self._preempted_now = set()                  # preempted in this step: not taken back in it
        out = self._schedule()
        if not out and self._oldest() >= 0 and self._reclaim():
            out = self._schedule()
        return out

    def _schedule(self) -> list[Scheduled]:
        out: list[Scheduled] = []
        budget = self.cfg.max_num_tokens
        for seq in list(self.running):              # decodes (and unfinished chunked prefills) first
            if seq not in self.running or budget == 0 or seq.paused or len(out) >= self.cfg.max_batch_size:
                continue                            # (a resumed reader waits for a slot like the others)
            num_new = min(seq.num_tokens - seq.num_cached, budget)
            while True:
                try:
                    self.alloc.grow(seq.block_table, seq.num_cached + num_new)
                    break
                except OutOfBlocks:
                    if self._reclaim():                 # from sequences taking no step, before running ones
                        continue
                    victim = self.running[-1]
                    self._preempt(victim)
                    self._preempted_now.add(victim.uid)
                    if victim is seq:
                        break
            if seq.status is Status.RUNNING:
                out.append(Scheduled(seq, num_new))
                budget -= num_new
        batch = set().union(*(s.experts for s in self.running)) if self.cfg.routing_aware_batching else set()
        youngest = 0                                   # the youngest request admitted in this round
        # a paused sequence (its reader is behind) keeps its KV blocks but no batch slot: others take its place
        active = sum(not s.paused for s in self.running)
        while self.waiting and budget > 0 and active < self.cfg.max_batch_size:
            pick = self._next_waiting(batch)
            if pick < 0:                                       # every waiting one is paused by its reader
                break
            for i in dict.fromkeys((pick, self._oldest())):    # the preferred one; if it does not fit, the oldest
                seq = self.waiting[i]
                num_new = min(seq.num_tokens - seq.num_cached, budget)
                try:
                    self.alloc.grow(seq.block_table, seq.num_cached + num_new)
                    break
                except OutOfBlocks:
                    continue
            else:
                break
            del self.waiting[i]
            youngest = max(youngest, seq.uid)
            batch |= seq.experts
            seq.status = Status.RUNNING
            self.running.append(seq)
            active += 1
            out.append(Scheduled(seq, num_new))
            budget -= num_new
        for older in self.waiting:                     # passed over in this round: a younger one went ahead
            if older.uid < youngest:
                older.passed_over += 1
        # decode sequences (one new token after a cached prefix) first, as StepInputs expects
        out.sort(key=lambda s: 0 if s.num_new == 1 and s.seq.num_cached > 0 else 1)
        return out
