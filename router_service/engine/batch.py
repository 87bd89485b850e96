"""One engine step's batch split into micro-batches, and which sequence each logits row belongs to.

Plain Python, no torch. The scheduler lists decodes first; contiguous slices keep that order inside each
micro-batch (as StepInputs needs), and the model returns the sampled rows of every micro-batch
concatenated in order, so `Step.sampled` is the one place that pairs logits rows with sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from router_service.engine.scheduler import Scheduled
from router_service.engine.sequence import Sequence


@dataclass(frozen=True)
class Step:
    micro_batches: tuple[tuple[Scheduled, ...], ...]
    sampled: tuple[Sequence, ...]   # the sequences that sample this step, in the order of the logits rows

    @staticmethod
    def split(batch: list[Scheduled], num_micro_batches: int) -> Step:
        """Contiguous, balanced slices (sizes differ by at most one); never an empty micro-batch."""
        if not batch:
            return Step((), ())
        n = min(num_micro_batches, len(batch))
        bounds = [len(batch) * j // n for j in range(n + 1)]
        micro = tuple(tuple(batch[lo:hi]) for lo, hi in zip(bounds, bounds[1:], strict=False))
        # fixed here, before the step runs: `Scheduled.samples` reads num_cached, which advance() moves on
        return Step(micro, tuple(s.seq for mb in micro for s in mb if s.samples))

    @property
    def scheduled(self) -> list[Scheduled]:
        return [s for mb in self.micro_batches for s in mb]

    def advance(self) -> None:
        """The step ran: every scheduled token's K/V is in the cache now."""
        for s in self.scheduled:
            s.seq.num_cached += s.num_new
