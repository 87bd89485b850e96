"""What the engine sends back to a request's handler: tokens, then one `Finished` per choice or a `Failed`.
No torch."""

from __future__ import annotations

import enum
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from router_service.engine.sequence import FinishReason, Sampled


class FailureCode(enum.Enum):
    """Named as gRPC status codes, so the server maps them by name; clients retry only UNAVAILABLE."""

    UNAVAILABLE = "unavailable"     # a worker failed or the router is shutting down: retrying may succeed
    INTERNAL = "internal"           # a bug in the engine step: retrying the same request will not help


@dataclass(frozen=True)
class Tokens:
    token_ids: list[int]
    logits: list[bytes]             # float32 [V] per token, when the request asked for them
    index: int = 0                  # which of the request's n choices
    logprobs: tuple[Sampled, ...] = ()   # per token, when the request asked for them
    stop_token: bool = False        # the last token is the stop token or EOS that ends the choice (no text)


@dataclass(frozen=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float
    index: int = 0


@dataclass(frozen=True)
class Failed:
    code: FailureCode
    message: str
    index: int = 0                  # the choice that failed (the handler ends the whole request)


Event = Tokens | Finished | Failed


class Outputs:
    """One request's events, in order, for its handler to read; the engine's side of backpressure. A request
    whose reader falls `high` token events behind is `full`: the engine pauses its sequences (they keep their
    KV but take no steps) so an unread stream holds a bounded amount of memory, and the reader's `get` resumes
    them (`on_room`) once it is back to `low`."""

    def __init__(self, on_room: Callable[[], None] = lambda: None, high: int = 64, low: int = 16) -> None:
        self._q: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self.unread = 0                     # token events put and not yet read
        self.high, self.low = high, low
        self.on_room = on_room
        self.paused = False                 # the engine paused this request's sequences

    def count(self, ev: Event) -> None:
        """An event on its way (the engine's outbox, which alone puts events here): a token event counts as
        unread from now on, delivered or not."""
        if isinstance(ev, Tokens):
            with self._lock:
                self.unread += 1

    def deliver(self, ev: Event) -> None:
        """The outbox's flush: the reader's `get` returns it (counted before, by `count`)."""
        self._q.put(ev)

    def pause_if_full(self) -> bool:
        """Whether the reader is `high` events behind; if so the request counts as paused until it reads."""
        with self._lock:
            if self.unread >= self.high and not self.paused:
                self.paused = True
                return True
            return False

    def get(self, timeout: float | None = None) -> Event:
        ev = self._q.get(timeout=timeout)
        if isinstance(ev, Tokens):
            with self._lock:
                self.unread -= 1
                resume = self.paused and self.unread <= self.low
                if resume:
                    self.paused = False
            if resume:
                self.on_room()
        return ev

    def empty(self) -> bool:
        return self._q.empty()
