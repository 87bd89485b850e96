"""The engine's events on their way to the requests' handlers, held back until the engine thread waits.

Each stream handler that an event wakes runs Python: gRPC's synchronous send, the text, the message. With 32
streams that is ~4 ms of CPU a step, all of it under the GIL. Delivered the moment a step samples them, the
handlers take the GIL from the engine thread just as it builds the next step: measured on the small bench
model at 32 streams over `serve --workers 2`, `prepare` took 4.4 ms a step for 0.4 ms of its own work. Held
here, they are delivered when the engine next blocks with the GIL released (its first wait on a worker's
reply: `Experts.stepping`'s `while_waiting`), or else when the step's forward ends, or before the engine
goes idle or stops: no event waits longer than one forward, and the handlers' Python overlaps the workers.
A step with fewer than HOLD_FROM events sends them at once.

Order is kept: events are delivered in the order they were put, one queue's as every other's (a request's
`Finished` after its last `Tokens`). Token events count as unread when put (`Outputs.count`), so the
engine's backpressure bound is exact whether or not they have been delivered yet.
"""

from __future__ import annotations

import threading

from router_service.engine.events import Event, Outputs

# A step with fewer events than this sends them at once (Engine._postprocess): a handler or two cost the engine little
# there, and held they would take the cores from the workers instead. Measured on the small model (output tok/s,
# alternating runs, docs/performance.md): held or not, 83.8 / 85.5 at one stream and 129.2 / 132.3 at two (within
# the spread), but held 222.7 / 216.1 against 210.9 / 201.8 at four.
HOLD_FROM = 4


class Outbox:
    """Events put by the engine (its thread, or `Engine.stop`'s), delivered in order by `flush`."""

    def __init__(self) -> None:
        self._held: list[tuple[Outputs, Event]] = []
        self._lock = threading.Lock()         # put and flush from two threads keep one order

    def put(self, outputs: Outputs, ev: Event) -> None:
        with self._lock:
            outputs.count(ev)
            self._held.append((outputs, ev))

    def flush(self) -> None:
        """Deliver every held event, in order (under the lock: a second flusher never overtakes the first)."""
        with self._lock:
            held, self._held = self._held, []
            for outputs, ev in held:
                outputs.deliver(ev)

    def __len__(self) -> int:
        return len(self._held)
