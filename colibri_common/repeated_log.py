"""One log line per incident, not per occurrence: a worker that is down fails every engine step that needs it,
and a router logged one identical ERROR a step (thousands in a second under load, the reason drowned). The first
line of a reason is said at once; while the same reason repeats it is said again at most every `every_s`
seconds, with how many times it happened since."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RepeatedLog:
    def __init__(self, log: logging.Logger, every_s: float = 5.0, level: int = logging.ERROR,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.every_s, self.level, self.clock = log, every_s, level, clock
        self.reason = ""            # the last reason said
        self.said_at = 0.0
        self.held = 0               # times it happened since it was last said

    def say(self, reason: str, line: str) -> bool:
        """Log `line` (about `reason`) unless the same reason was said within every_s; True when logged."""
        now = self.clock()
        if reason == self.reason and now - self.said_at < self.every_s:
            self.held += 1
            return False
        if self.held and reason != self.reason:
            self._said_held()
        elif self.held:
            line += f" ({self.held} more like it in the last {now - self.said_at:.0f} s)"
        self.log.log(self.level, "%s", line)
        self.reason, self.said_at, self.held = reason, now, 0
        return True

    def end(self) -> None:
        """The incident is over (a step went through): the times it happened since it was last said, said."""
        if self.held:
            self._said_held()
        self.reason, self.held = "", 0

    def _said_held(self) -> None:
        """The count of the held repeats, naming their reason (in a log that several threads and processes write,
        "the line before" is any line)."""
        self.log.log(self.level, "(%s: %d more time%s)", self.reason[:200], self.held, "s" * (self.held > 1))
