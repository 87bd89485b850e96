"""MoE stage 3 of 4, transport (route → partition → **transport** → combine): the links to the workers over gRPC.

One `WorkerLink` per expert worker. `send` returns at once with a reply handle, so the engine can compute
attention for one micro-batch while the workers compute experts for another; `Reply.get` blocks for the
answer. Two kinds here (the same-host one, `same_host.py`, extends the stream), chosen by `--transport`:

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
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from colibri_common.errors import ColibriError
from colibri_common.frames import Payload
from colibri_common.pb import expert_pb2, expert_pb2_grpc
from colibri_common.serving import CHANNEL_OPTIONS, RECONNECT_OPTIONS, channel_options, grpc_timeout
from colibri_common.token_gate import with_token
from router_service.moe.heartbeat import Heartbeat

log = logging.getLogger("colibri.router")

# A worker that answers INTERNAL or INVALID_ARGUMENT has a bug or was sent a bad request: retrying will not help.
NOT_RETRYABLE = (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)


def _unreachable(address: str) -> str:
    """Why a HOST:PORT cannot be reached, said plainly (gRPC waiting for a channel says only "Deadline Exceeded"):
    "; connecting to it: Connection refused" or "...: cannot resolve ..."; "" where a TCP connection opens (or the
    address is not HOST:PORT)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in host:          # dns:///..., unix:...: gRPC's own forms
        return ""
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=2.0).close()
    except socket.gaierror as exc:
        return f"; connecting to it: cannot resolve {host!r} ({exc.strerror})"
    except OSError as exc:
        return f"; connecting to it: {exc.strerror or exc}"
    return ""


FrameWriter = Callable[[socket.socket], None]   # writes one whole frame to a connected socket; OSError if it cannot


class WorkerError(ColibriError):
    """A worker failed, timed out or is unreachable; the message names it (one line where it stops a start: a
    worker that does not match the router). `retryable`: whether the same request may succeed later (the worker
    was down or slow) rather than hit the same bug again. `unsynced`: the worker answered that it does not hold
    the plan the call was made under (FAILED_PRECONDITION: restarted on its own plan, or never assigned one), so
    it is up and a re-sync makes it serve again."""

    def __init__(self, message: str, retryable: bool = True, unsynced: bool = False) -> None:
        super().__init__(message)
        self.retryable, self.unsynced = retryable, unsynced

    @staticmethod
    def from_rpc(message: str, exc: BaseException) -> WorkerError:
        code = exc.code() if isinstance(exc, grpc.RpcError) else None
        return WorkerError(message, code not in NOT_RETRYABLE, code == grpc.StatusCode.FAILED_PRECONDITION)


def _detail(exc: BaseException) -> str:
    return f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else "its stream ended"


class Reply:
    """One worker's answer to one ForwardRequest, on its way."""

    def get(self) -> expert_pb2.ForwardResponse:
        raise NotImplementedError

    def get_bytes(self) -> bytes | bytearray | None:
        """As `get`, but the answer's ForwardResponse bytes where its link reads them unparsed (the same-host socket:
        the router's combine reads them natively); None where it comes parsed (gRPC): then `get` returns it."""
        self.get()
        return None

    def done(self) -> bool:
        """Whether the answer is here (get() would not wait)."""
        raise NotImplementedError


class UnaryReply(Reply):
    def __init__(self, address: str, layer: int, future: grpc.Future) -> None:
        self.address, self.layer, self.future = address, layer, future

    def done(self) -> bool:
        return self.future.done()

    def get(self) -> expert_pb2.ForwardResponse:
        try:
            return self.future.result()
        except grpc.RpcError as exc:
            raise WorkerError.from_rpc(f"expert worker {self.address} failed on layer {self.layer}: "
                                       f"{_detail(exc)}", exc) from exc


class StreamReply(Reply):
    def __init__(self, link: StreamLink, layer: int) -> None:
        self.link, self.layer = link, layer
        self.response: expert_pb2.ForwardResponse | None = None
        self.payload: Payload | None = None   # its bytes, unparsed (a same-host socket's answer)
        self.error: str | None = None            # set when its stream was reset before it was answered
        self.unsynced = False                    # its error is the worker's "not under that plan"

    def done(self) -> bool:
        return self.response is not None or self.payload is not None or self.error is not None

    def get(self) -> expert_pb2.ForwardResponse:
        return self.link.receive(self)

    def get_bytes(self) -> Payload | None:
        return self.link.receive_bytes(self)


def fail_in_flight(replies: collections.deque[StreamReply], why: str, unsynced: bool = False) -> None:
    """A link was reset: every reply still awaited on it fails with `why` (its `get` raises WorkerError);
    `unsynced`: because the worker answered it does not hold the plan (a re-sync, not a ban, is what it needs)."""
    for r in replies:
        r.error, r.unsynced = why, unsynced
    replies.clear()


@dataclass(frozen=True)
class Access:
    """How a router proves itself to its workers: mutual TLS credentials, the fleet's token
    (colibri_common/fleet_token.py), both or neither."""

    credentials: grpc.ChannelCredentials | None = None
    token: str | None = None


OPEN_ACCESS = Access()


# A worker that died comes back in a fraction of a second (serve, Kubernetes): its channel tries again every quarter
# second at most, so the router finds it (health checks, re-sync) that soon, not up to a second later (replacing
# RECONNECT_OPTIONS' maximum).
WORKER_RECONNECT = [("grpc.max_reconnect_backoff_ms", 250)]


class WorkerLink:
    """The router's connection to one expert worker."""

    def __init__(self, address: str, timeout_s: float, access: Access = OPEN_ACCESS) -> None:
        self.address, self.timeout_s = address, grpc_timeout(timeout_s)
        options = channel_options(CHANNEL_OPTIONS, RECONNECT_OPTIONS, WORKER_RECONNECT)
        self._raw = grpc.insecure_channel(address, options=options) if access.credentials is None else \
            grpc.secure_channel(address, access.credentials, options=options)     # mutual TLS to the worker
        self.channel = with_token(self._raw, access.token)                       # every call carries the token
        self.stub = expert_pb2_grpc.ExpertWorkerStub(self.channel)
        self.closed = False

    def describe(self, deadline: float) -> expert_pb2.DescribeResponse:
        """Ask until it answers (a worker may still be loading) or `deadline` (time.monotonic) passes; the pause
        between asks grows from 50 ms to 0.5 s (a fleet's router and workers start at once: most are up soon)."""
        pause = 0.05
        start = said = time.monotonic()
        last = "no answer yet"
        while True:
            now = time.monotonic()
            if now - said >= 10.0:       # a worker that is not up: said every 10 s, not only when the wait ends
                log.warning("expert worker %s has not answered for %.0f s (%s); waiting up to %.0f s more",
                            self.address, now - start, last, max(0.0, deadline - now))
                said = now
            try:
                return self.stub.Describe(expert_pb2.DescribeRequest(), wait_for_ready=True,
                                          timeout=min(10.0, max(0.1, deadline - time.monotonic())))
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    exc = self._why_not_connected(exc)
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    raise WorkerError(f"{self.address} is not an expert worker (it has no colibri.v1.ExpertWorker "
                                      f"service: a router's or another server's address?)", retryable=False) from exc
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise WorkerError(f"expert worker {self.address} refused this router: {exc.details()}",
                                      retryable=False) from exc
                now_said = f"{exc.code().name}: {exc.details()}"
                if time.monotonic() > deadline:
                    before = f"; before that {last}" if last not in ("no answer yet", now_said) else ""
                    tcp = _unreachable(self.address)
                    tcp = "" if tcp.rpartition(": ")[2] in exc.details() else tcp     # said already
                    raise WorkerError(f"expert worker {self.address} did not answer Describe: {exc.details()}"
                                      f"{before}{tcp}") from exc
                last = now_said
                time.sleep(pause)
                pause = min(0.5, 2 * pause)

    def _why_not_connected(self, exc: grpc.RpcError) -> grpc.RpcError:
        """A call that waited for the channel only says "Deadline Exceeded"; one that does not wait gets the
        channel's own reason (connection refused, a TLS handshake that failed and why), where there is one."""
        try:
            self.stub.Describe(expert_pb2.DescribeRequest(), wait_for_ready=False, timeout=1.0)
        except grpc.RpcError as now:
            if now.code() == grpc.StatusCode.UNAVAILABLE and now.details():
                return now
        return exc

    def assign(self, request: expert_pb2.AssignRequest, timeout_s: float, wait: bool = True,
               silence_s: float = 0.0) -> expert_pb2.AssignResponse:
        """The router's plan for this worker (it loads what it lacks before it answers); `wait`: for a worker that
        is still starting (not for one being released, which may be gone). `silence_s` > 0: given up once the
        worker has answered no health check for that long (frozen, its host hung, killed before the call reached
        it), not only at `timeout_s`."""
        what = f"expert worker {self.address} did not take placement epoch {request.epoch}"
        try:
            if silence_s <= 0:
                return self.stub.Assign(request, timeout=grpc_timeout(timeout_s), wait_for_ready=wait)
            call = self.stub.Assign.future(request, timeout=grpc_timeout(timeout_s), wait_for_ready=wait)
            beat = Heartbeat(self.channel)
            try:
                while True:
                    try:
                        return call.result(timeout=0.25)
                    except grpc.FutureTimeoutError:
                        quiet = beat.quiet_for()
                        if quiet >= silence_s:
                            call.cancel()
                            raise WorkerError(f"{what}: it answered no health check for {quiet:.0f} s while it was "
                                              f"to load ({beat.why}); frozen, its host hung or unreachable") from None
            finally:
                beat.close()
        except grpc.RpcError as exc:
            raise WorkerError.from_rpc(f"{what}: {_detail(exc)}", exc) from exc

    def send(self, request: expert_pb2.ForwardRequest) -> Reply:
        raise NotImplementedError

    def send_written(self, write: FrameWriter, layer: int) -> Reply | None:
        """A ForwardRequest of `layer` that `write` puts on the socket as one whole frame itself
        (kernels.native_wire.forward_send), where this link sends frames (`local`: the same-host socket); None where
        it sends messages (then `send`)."""
        return None

    @property
    def local(self) -> bool:
        """Whether the layers go over the worker's same-host socket (same_host.py) rather than gRPC."""
        return False

    def check_deadline(self) -> None:
        """Called about once a second by the watchdog."""

    def abandon(self, why: str, waited_s: float) -> bool:
        """Give up on the answers in flight now, as --worker-timeout would later, if a read has waited on them for
        `waited_s` or more: it fails with `why` (the caller sends their pairs to replicas). False otherwise, and on
        unary calls, which keep their own deadline."""
        return False

    def close(self) -> None:
        self.closed = True
        self._raw.close()


class UnaryLink(WorkerLink):
    def send(self, request: expert_pb2.ForwardRequest) -> Reply:
        return UnaryReply(self.address, request.layer, self.stub.Forward.future(request, timeout=self.timeout_s))


class _OpenStream:
    """One ForwardStream call: requests in through a queue, answers out in order. The watchdog reads
    `waiting_since` and cancels through this one object, so it never touches a stream opened after it."""

    def __init__(self, stub: expert_pb2_grpc.ExpertWorkerStub) -> None:
        self.requests: queue.SimpleQueue[expert_pb2.ForwardRequest | None] = queue.SimpleQueue()
        self.responses: Iterator[expert_pb2.ForwardResponse] = stub.ForwardStream(self._pump())
        self.waiting_since: float | None = None
        self.why: str | None = None               # why it was cancelled, where the router chose to

    def _pump(self) -> Iterator[expert_pb2.ForwardRequest]:
        while (req := self.requests.get()) is not None:
            yield req

    def cancel(self, why: str | None = None) -> None:
        self.why = self.why or why
        self.requests.put(None)
        self.responses.cancel()  # type: ignore[attr-defined]


class StreamLink(WorkerLink):
    """A healthy worker answers every request it was sent, in order, even for a step that failed elsewhere:
    such an answer stays with its reply in `_awaiting` and is read off (and dropped with the failed step)
    before the next step's. Only this link's own failure resets it, failing what was in flight on it."""

    def __init__(self, address: str, timeout_s: float, access: Access = OPEN_ACCESS) -> None:
        super().__init__(address, timeout_s, access)
        self._stream: _OpenStream | None = None
        self._awaiting: collections.deque[StreamReply] = collections.deque()   # sent, not yet answered

    def send(self, request: expert_pb2.ForwardRequest) -> Reply:
        if self._stream is not None and self._stream.responses.done():  # type: ignore[attr-defined]
            # it ended while idle (the worker died or restarted between steps): a new one, not a failed step
            self.reset(f"expert worker {self.address}: its stream ended")
        if self._stream is None:
            self._stream = _OpenStream(self.stub)
        reply = StreamReply(self, request.layer)
        self._awaiting.append(reply)
        self._stream.requests.put(request)
        return reply

    def receive(self, reply: StreamReply) -> expert_pb2.ForwardResponse:
        """Answers come in request order: read until `reply`'s arrives, filing the earlier ones."""
        while reply.response is None:
            stream = self._stream
            if reply.error is not None or stream is None:
                raise WorkerError(reply.error or f"expert worker {self.address}: its stream was reset",
                                  unsynced=reply.unsynced)
            stream.waiting_since = time.monotonic()
            try:
                resp = next(stream.responses)
            except (grpc.RpcError, StopIteration) as exc:
                message = f"expert worker {self.address} failed on layer {reply.layer}: {stream.why or _detail(exc)}"
                error = WorkerError.from_rpc(message, exc)
                self.reset(f"expert worker {self.address}: its stream was reset after a failure", error.unsynced)
                raise error from exc
            finally:
                stream.waiting_since = None
            self._awaiting.popleft().response = resp
        return reply.response

    def receive_bytes(self, reply: StreamReply) -> Payload | None:
        """`reply`'s bytes where this link reads them unparsed; a gRPC stream parses them: None once received."""
        self.receive(reply)
        return None

    def check_deadline(self) -> None:
        stream = self._stream                       # one read: the stream this check may cancel
        since = stream.waiting_since if stream is not None else None
        if since is not None and time.monotonic() - since > self.timeout_s:
            log.error("expert worker %s did not answer within %.0fs; cancelling its stream", self.address,
                      self.timeout_s)
            stream.cancel(f"no answer within {self.timeout_s:g}s (--worker-timeout)")  # type: ignore[union-attr]

    def abandon(self, why: str, waited_s: float) -> bool:
        stream = self._stream
        since = stream.waiting_since if stream is not None else None
        if since is None or time.monotonic() - since < waited_s:
            return False
        stream.cancel(why)  # type: ignore[union-attr]
        return True

    def reset(self, why: str, unsynced: bool = False) -> None:
        """Drop the open stream and fail what was in flight on it; the next send reopens it."""
        if self._stream is not None:
            self._stream.cancel()
        self._stream = None
        fail_in_flight(self._awaiting, why, unsynced)

    def close(self) -> None:
        self.reset(f"expert worker {self.address}: the router is closing its connections")
        super().close()
