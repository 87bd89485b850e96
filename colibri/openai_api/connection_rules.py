"""What the front's HTTP protocol holds a connection to below the app, beside head_limit's bound on a head's size:

- **A time bound on reading a request** (--request-read-timeout, as nginx's client_header_timeout and
  client_body_timeout). A connection that sends nothing for that long before its first request, or while a request
  of it is incomplete (its head, or a body the app waits for), is closed; one whose request had begun is answered
  408 first (OpenAI's error shape, `connection: close`). uvicorn times out only idle keep-alive connections between
  requests, so a client that opened connections and sent part of a request, or nothing, held each one (and its file
  descriptor) for as long as it liked. The clock restarts with every read: a slow client that keeps sending is not
  cut off. It does not run against the client while the front itself holds things up: an earlier request on the
  connection still being answered, or its reads paused by flow control.
- **What the HTTP parser refuses** (a bad Content-Length, broken chunked framing, a control character in a header)
  is answered 400 in OpenAI's error shape with the parser's reason, where uvicorn sent plain text that named none.

Both are counted by `refused` (the metrics' colibri_openai:refused_total{status}): a request whose body the app was
waiting for is counted by the app, as a 408 (`READ_TIMED_OUT` in its scope tells it why the body ended).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from colibri.openai_api.errors import ApiError

log = logging.getLogger("colibri.openai")
READ_TIMED_OUT = "colibri.read_timed_out"       # the scope key set on a request whose body timed out


def answer(status: int, reason: str, message: str, code: str | None = None) -> bytes:
    """A whole error response, bytes on the wire, that closes the connection."""
    body = json.dumps(ApiError(status, message, code=code).body()).encode()
    return b"".join([b"HTTP/1.1 %d %s\r\n" % (status, reason.encode()), b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body])


def ruled_protocol(base: type[HttpToolsProtocol], read_timeout: float,
                   refused: Callable[[int], None]) -> type[HttpToolsProtocol]:
    """`base` (uvicorn's httptools protocol, or head_limit's) held to the rules above."""

    class Ruled(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.reading = False                          # a request has begun and not all of it has come
            self.read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:     # type: ignore[override]
            super().connection_made(transport)
            self._arm()                                   # its first request must begin in time too

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.reading and not self.transport.is_closing():
                self._arm()                               # the clock restarts with every read
            else:
                self._disarm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.reading = True

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self.reading = False

        def send_400_response(self, msg: str) -> None:
            exc = sys.exc_info()[1]                       # called inside uvicorn's `except HttpParserError`
            why = f" ({exc})" if exc is not None and str(exc) else ""
            refused(400)
            self.transport.write(answer(400, "Bad Request", f"the request is not valid HTTP/1.1{why}: check its "
                                        f"request line, its headers and its body's length (Content-Length or "
                                        f"chunked)", code="invalid_http"))
            self.transport.close()

        def _arm(self) -> None:
            self._disarm()
            self.read_timer = self.loop.call_later(read_timeout, self._expired)

        def _disarm(self) -> None:
            if self.read_timer is not None:
                self.read_timer.cancel()
                self.read_timer = None

        def _expired(self) -> None:
            self.read_timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle                            # the request on hand (or the last one answered)
            answering = cycle is not None and not cycle.response_complete and not cycle.more_body
            if answering or self.pipeline or self.flow.read_paused:
                self._arm()                               # the front holds things up, not the client
                return
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            if not self.reading:                          # nothing begun: no request to answer
                refused(408)
                log.info("closed a connection from %s that sent no request in %gs (--request-read-timeout)",
                         client, read_timeout)
            elif cycle is not None and cycle.more_body and cycle.response_started:
                log.info("closed a connection from %s: the body of a request answered already stopped coming "
                         "for %gs (--request-read-timeout)", client, read_timeout)
            else:
                if cycle is not None and cycle.more_body:   # the app waits for this body: it counts the 408
                    cycle.scope[READ_TIMED_OUT] = True    # type: ignore[literal-required]
                else:                                     # its head was incomplete: no app saw it
                    refused(408)
                log.warning("closed a connection from %s whose request stopped coming for %gs "
                            "(--request-read-timeout): 408", client, read_timeout)
                self.transport.write(answer(408, "Request Timeout", f"the request stopped coming: nothing "
                                            f"arrived for {read_timeout:g} s before it was whole (the front's "
                                            f"--request-read-timeout); send it at once", code="request_timeout"))
            self.transport.close()

    return Ruled
