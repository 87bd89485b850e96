"""Streams whose client stopped reading: found by a watchdog and cancelled, so they free their thread.

gRPC's synchronous server sends a streamed response on the handler's thread and waits until the transport
takes it; a client that never reads fills the flow-control window and that thread waits for good (with
enough such clients, the whole pool). The handler marks each send (`with sending:` around its `yield`);
a send that has not completed within `timeout` seconds cancels the call (the client sees CANCELLED) and
the request in the engine (its KV blocks are freed).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from colibri_common.heap import return_free_heap

log = logging.getLogger("colibri.router")


class _Send:
    def __init__(self) -> None:
        self.since: float | None = None

    def __enter__(self) -> None:
        self.since = time.monotonic()

    def __exit__(self, *exc: object) -> None:
        self.since = None


class StallWatch:
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.cancelled = 0
        self._open: dict[int, tuple[_Send, grpc.ServicerContext, Callable[[], object]]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def watch(self, context: grpc.ServicerContext, cancel: Callable[[], object]) -> Iterator[_Send]:
        send = _Send()
        with self._lock:
            self._open[id(send)] = (send, context, cancel)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
                self._thread.start()
        try:
            yield send
        finally:
            with self._lock:
                self._open.pop(id(send), None)

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.timeout / 4))
            now = time.monotonic()
            with self._lock:
                stalled = [(k, ctx, cancel) for k, (send, ctx, cancel) in self._open.items()
                           if send.since is not None and now - send.since > self.timeout]
                for k, _, _ in stalled:
                    del self._open[k]
            for _, ctx, cancel in stalled:
                log.warning("a client has not read its stream for %.0fs: cancelling its request", self.timeout)
                self.cancelled += 1
                cancel()
                ctx.cancel()
            if stalled:
                return_free_heap()          # what their unsent messages held goes back to the OS
