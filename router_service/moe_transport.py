"""MoE stage 3 of 4, transport (route → partition → **transport** → combine): the only place that knows gRPC.

One `WorkerLink` per expert worker. `send` returns at once with a reply handle, so the engine can compute
attention for one micro-batch while the workers compute experts for another; `Reply.get` blocks for the
answer. Two kinds, chosen by `--transport`:

- `StreamLink`: a bidirectional `ForwardStream` held open per worker, one message per MoE layer per step;
  answers come back in request order. A watchdog cancels a stream whose worker has not answered within
  the timeout; after a failure the link reopens its stream on the next send (the channel reconnects).
- `UnaryLink`: one `Forward` call per layer, each with its own deadline.

Measured on the 2-core dev machine (two workers answering at once): unary futures ≈1.7-2.1 ms per round,
streams ≈0.7-0.9 ms; streams are the default.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from colibri_common.pb import expert_pb2, expert_pb2_grpc
from colibri_common.serving import CHANNEL_OPTIONS

log = logging.getLogger("colibri.router")


class WorkerError(Exception):
    """A worker failed, timed out or is unreachable; the message names it."""


def _detail(exc: BaseException) -> str:
    return f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else "its stream ended"


class Reply:
    """One worker's answer to one ForwardRequest, on its way."""

    def get(self) -> expert_pb2.ForwardResponse:
        raise NotImplementedError


class UnaryReply(Reply):
    def __init__(self, address: str, layer: int, future: grpc.Future) -> None:
        self.address, self.layer, self.future = address, layer, future

    def get(self) -> expert_pb2.ForwardResponse:
        try:
            return self.future.result()
        except grpc.RpcError as exc:
            raise WorkerError(f"expert worker {self.address} failed on layer {self.layer}: "
                              f"{_detail(exc)}") from exc


class StreamReply(Reply):
    def __init__(self, link: StreamLink, layer: int) -> None:
        self.link, self.layer = link, layer
        self.response: expert_pb2.ForwardResponse | None = None
        self.error: str | None = None            # set when its stream was reset before it was answered

    def get(self) -> expert_pb2.ForwardResponse:
        return self.link.receive(self)


class WorkerLink:
    """The router's connection to one expert worker."""

    def __init__(self, address: str, timeout_s: float) -> None:
        self.address, self.timeout_s = address, timeout_s
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = expert_pb2_grpc.ExpertWorkerStub(self.channel)

    def describe(self, deadline: float) -> expert_pb2.DescribeResponse:
        """Ask until it answers (a worker may still be loading) or `deadline` (time.monotonic) passes."""
        while True:
            try:
                return self.stub.Describe(expert_pb2.DescribeRequest(), timeout=10, wait_for_ready=True)
            except grpc.RpcError as exc:
                if time.monotonic() > deadline:
                    raise WorkerError(f"expert worker {self.address} did not answer Describe: "
                                      f"{exc.details()}") from exc
                time.sleep(0.5)

    def send(self, request: expert_pb2.ForwardRequest) -> Reply:
        raise NotImplementedError

    def check_deadline(self) -> None:
        """Called about once a second by the watchdog."""

    def close(self) -> None:
        self.channel.close()


class UnaryLink(WorkerLink):
    def send(self, request: expert_pb2.ForwardRequest) -> Reply:
        return UnaryReply(self.address, request.layer, self.stub.Forward.future(request, timeout=self.timeout_s))


class StreamLink(WorkerLink):
    def __init__(self, address: str, timeout_s: float) -> None:
        super().__init__(address, timeout_s)
        self._requests: queue.SimpleQueue[expert_pb2.ForwardRequest | None] | None = None
        self._responses: Iterator[expert_pb2.ForwardResponse] | None = None
        self._awaiting: collections.deque[StreamReply] = collections.deque()   # sent, not yet answered
        self._waiting_since: float | None = None

    def _open(self) -> None:
        requests: queue.SimpleQueue[expert_pb2.ForwardRequest | None] = queue.SimpleQueue()

        def pump() -> Iterator[expert_pb2.ForwardRequest]:
            while (req := requests.get()) is not None:
                yield req

        self._requests, self._responses = requests, self.stub.ForwardStream(pump())

    def send(self, request: expert_pb2.ForwardRequest) -> Reply:
        if self._requests is None:
            self._open()
        reply = StreamReply(self, request.layer)
        self._awaiting.append(reply)
        self._requests.put(request)  # type: ignore[union-attr]
        return reply

    def receive(self, reply: StreamReply) -> expert_pb2.ForwardResponse:
        """Answers come in request order: read until `reply`'s arrives, filing the earlier ones."""
        while reply.response is None:
            if reply.error is not None or self._responses is None:
                raise WorkerError(reply.error or f"expert worker {self.address}: its stream was reset")
            self._waiting_since = time.monotonic()
            try:
                resp = next(self._responses)
            except (grpc.RpcError, StopIteration) as exc:
                message = f"expert worker {self.address} failed on layer {reply.layer}: {_detail(exc)}"
                self.reset(f"expert worker {self.address}: its stream was reset after a failure")
                raise WorkerError(message) from exc
            finally:
                self._waiting_since = None
            self._awaiting.popleft().response = resp
        return reply.response

    def check_deadline(self) -> None:
        since, responses = self._waiting_since, self._responses
        if since is not None and responses is not None and time.monotonic() - since > self.timeout_s:
            log.error("expert worker %s did not answer within %.0fs; cancelling its stream", self.address,
                      self.timeout_s)
            responses.cancel()  # type: ignore[attr-defined]

    def reset(self, why: str) -> None:
        """Drop the open stream and fail what was in flight on it; the next send reopens it."""
        if self._requests is not None:
            self._requests.put(None)
            self._responses.cancel()  # type: ignore[union-attr]
        self._requests = self._responses = None
        for r in self._awaiting:
            r.error = why
        self._awaiting.clear()

    def close(self) -> None:
        self.reset(f"expert worker {self.address}: the router is closing its connections")
        super().close()


LINKS: dict[str, type[WorkerLink]] = {"stream": StreamLink, "unary": UnaryLink}


class Links:
    """Every worker's link, plus the watchdog thread that enforces the stream deadlines."""

    def __init__(self, addresses: tuple[str, ...], transport: str, timeout_s: float) -> None:
        if transport not in LINKS:
            raise ValueError(f"transport '{transport}' is unknown; use one of {', '.join(LINKS)}")
        self.links = [LINKS[transport](a, timeout_s) for a in addresses]
        self._closed = threading.Event()
        threading.Thread(target=self._watchdog, name="moe-watchdog", daemon=True).start()

    def _watchdog(self) -> None:
        while not self._closed.wait(1.0):
            for link in self.links:
                link.check_deadline()

    def close(self) -> None:
        self._closed.set()
        for link in self.links:
            link.close()
