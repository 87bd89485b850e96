"""MoE stage 3 of 4, transport, on the same host: Forward over the worker's UNIX socket; and the set of links.

A worker that names a local socket in its Describe (`colibri serve` gives each one) and whose socket this
router can reach is sent each MoE layer as framed protobuf messages (colibri_common/frames.py) instead of a
gRPC stream: the same bytes without HTTP/2, its flow control and gRPC's polling threads (on a 2-core machine
with two workers those took about a third of a one-stream decode step). Anything else, a worker on another
host or in another pod, keeps the gRPC stream: `LocalLink` is a `StreamLink` that takes the socket when there
is one. Answers come back in request order; an error answer fails that request only; a closed connection or a
deadline fails what was in flight, as a reset stream does, and the next send connects again.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from pathlib import Path

import grpc

from colibri_common.frames import FrameError, Payload, payload_bytes, recv_payload, send_frame
from colibri_common.pb import expert_pb2
from colibri_common.serving import MAX_MESSAGE_BYTES
from router_service.moe.transport import (
    NOT_RETRYABLE,
    OPEN_ACCESS,
    Access,
    FrameWriter,
    Reply,
    StreamLink,
    StreamReply,
    UnaryLink,
    WorkerError,
    WorkerLink,
    fail_in_flight,
)

_CODES = {c.value[0]: c for c in grpc.StatusCode}
log = logging.getLogger("colibri.router")


class LocalLink(StreamLink):
    """A stream link that uses the worker's same-host socket whenever the worker names one this router reaches."""

    def __init__(self, address: str, timeout_s: float, access: Access = OPEN_ACCESS) -> None:
        super().__init__(address, timeout_s, access)
        self.socket_path: str | None = None
        self._sock: socket.socket | None = None
        self._pending: collections.deque[StreamReply] = collections.deque()    # sent on the socket, unanswered
        self._waiting_since: float | None = None
        self._cut: tuple[socket.socket, str] | None = None   # a socket the router shut, and why (timeout, abandon)

    def describe(self, deadline: float) -> expert_pb2.DescribeResponse:
        d = super().describe(deadline)
        self.socket_path = d.local_socket if d.local_socket and Path(d.local_socket).is_socket() else None
        return d

    @property
    def local(self) -> bool:
        return self.socket_path is not None

    def send(self, request: expert_pb2.ForwardRequest) -> Reply:
        if self.socket_path is None:
            return super().send(request)
        payload = request.SerializeToString()
        return self._send_frame(lambda sock: send_frame(sock, 0, payload), request.layer)

    def send_written(self, write: FrameWriter, layer: int) -> Reply | None:
        return None if self.socket_path is None else self._send_frame(write, layer)

    def _send_frame(self, write: FrameWriter, layer: int) -> Reply:
        reply = StreamReply(self, layer)
        for fresh in ((False, True) if self._sock is not None else (True,)):
            try:
                if fresh:
                    self._connect()
                write(self._sock)  # type: ignore[arg-type]
                break
            except OSError as exc:
                # a connection that was up may have died while idle (the worker restarted): one new one
                self._drop(f"expert worker {self.address}: its local connection failed: {exc}")
                if fresh:
                    reply.error = f"expert worker {self.address} is unreachable on {self.socket_path}: {exc}"
                    return reply
        self._pending.append(reply)
        return reply

    def _connect(self) -> None:
        assert self.socket_path is not None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self._sock, self._cut = sock, None

    def receive(self, reply: StreamReply) -> expert_pb2.ForwardResponse:
        if reply.payload is None and self.socket_path is None:    # (an answer filed unparsed is read from its bytes
            return super().receive(reply)                          # even if a re-sync has since lost the socket)
        if reply.response is None:
            reply.response = expert_pb2.ForwardResponse.FromString(payload_bytes(self._await(reply)))
        return reply.response

    def receive_bytes(self, reply: StreamReply) -> Payload | None:
        if reply.payload is None and self.socket_path is None:
            return super().receive_bytes(reply)
        return self._await(reply) if reply.response is None else None

    def _await(self, reply: StreamReply) -> Payload:
        """Read answers in order until `reply`'s is here (the earlier ones filed unparsed); its bytes."""
        while reply.payload is None:
            sock = self._sock
            if reply.error is not None or sock is None:
                raise WorkerError(reply.error or f"expert worker {self.address}: its local connection was reset",
                                  unsynced=reply.unsynced)
            self._waiting_since = time.monotonic()
            try:
                status, payload = recv_payload(sock, MAX_MESSAGE_BYTES)
            except (FrameError, OSError) as exc:
                cut = self._cut
                why = cut[1] if cut is not None and cut[0] is sock else f"its local connection broke ({exc})"
                self._cut = None
                message = f"expert worker {self.address} failed on layer {reply.layer}: {why}"
                self._drop(f"expert worker {self.address}: its local connection was reset after a failure")
                raise WorkerError(message) from exc
            finally:
                self._waiting_since = None
            answered = self._pending.popleft()
            if status == 0:
                answered.payload = payload                # parsed by its reader: natively, or by `receive`
                continue
            code = _CODES.get(status, grpc.StatusCode.UNKNOWN)
            answered.error = f"expert worker {self.address} failed on layer {answered.layer}: {code.name}: " \
                             f"{payload_bytes(payload).decode(errors='replace')}"
            answered.unsynced = code == grpc.StatusCode.FAILED_PRECONDITION
            if answered is reply:
                raise WorkerError(answered.error, retryable=code not in NOT_RETRYABLE, unsynced=answered.unsynced)
        return reply.payload

    def check_deadline(self) -> None:
        super().check_deadline()
        sock, since = self._sock, self._waiting_since
        if sock is not None and since is not None and time.monotonic() - since > self.timeout_s:
            log.error("expert worker %s did not answer within %.0fs (--worker-timeout); closing its local "
                      "connection", self.address, self.timeout_s)
            self._waiting_since = None                    # said once
            self._shut(sock, f"did not answer within {self.timeout_s:g}s (--worker-timeout)")

    def abandon(self, why: str, waited_s: float) -> bool:
        if self.socket_path is None:
            return super().abandon(why, waited_s)
        sock, since = self._sock, self._waiting_since
        if sock is None or since is None or time.monotonic() - since < waited_s:
            return False
        self._shut(sock, why)
        return True

    def _shut(self, sock: socket.socket, why: str) -> None:
        """The read waiting on this socket (or the next one) fails, saying `why`."""
        if self._cut is None or self._cut[0] is not sock:         # the first reason given for this socket
            self._cut = (sock, why)
        try:
            sock.shutdown(socket.SHUT_RDWR)               # the blocked read returns: the layer fails
        except OSError:
            pass

    def _drop(self, why: str) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        fail_in_flight(self._pending, why)

    def reset(self, why: str, unsynced: bool = False) -> None:
        self._drop(why)
        super().reset(why, unsynced)


LINKS: dict[str, type[WorkerLink]] = {"auto": LocalLink, "stream": StreamLink, "unary": UnaryLink}


class Links:
    """Every worker's link, plus the watchdog thread that enforces the deadlines."""

    def __init__(self, addresses: tuple[str, ...], transport: str, timeout_s: float, access: Access = OPEN_ACCESS
                 ) -> None:
        if transport not in LINKS:
            raise ValueError(f"transport '{transport}' is unknown; use one of {', '.join(LINKS)}")
        self.transport, self.timeout_s, self.access = transport, timeout_s, access
        self.links = [LINKS[transport](a, timeout_s, access) for a in addresses]
        self._closed = threading.Event()
        threading.Thread(target=self._watchdog, name="moe-watchdog", daemon=True).start()

    def connect(self, address: str) -> WorkerLink:
        """A link to one more worker (a resize); it takes the next index."""
        link = LINKS[self.transport](address, self.timeout_s, self.access)
        self.links = [*self.links, link]
        return link

    def reconnect(self, index: int) -> WorkerLink:
        """A fresh link in place of a closed one (a worker added back)."""
        link = LINKS[self.transport](self.links[index].address, self.timeout_s, self.access)
        links = list(self.links)
        links[index] = link
        self.links = links
        return link

    def _watchdog(self) -> None:
        while not self._closed.wait(1.0):
            for link in self.links:
                link.check_deadline()

    def close(self) -> None:
        self._closed.set()
        for link in self.links:
            link.close()
