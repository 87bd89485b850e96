"""What the front's HTTP protocol holds a connection to below the app, beside head_limit's bound on a head's size:

- **A time bound on reading a request** (--request-read-timeout, as nginx's client_header_timeout and
  client_body_timeout). A connection that sends no request for that long, or stops sending one (its head, or a body
  the app waits for) for that long, is closed; one whose request had begun is answered 408 first (OpenAI's error
  shape, `connection: close`). uvicorn times out only idle keep-alive connections between requests, so a client
  that opened connections and sent part of a request, or nothing, or blank lines, held each one (and its file
  descriptor) for as long as it liked. The clock restarts with every read, so a slow client that keeps sending
  is not cut off; it does not run against the client while the front holds things up (a response being sent on
  the connection, a pipelined request waiting its turn, an `Expect: 100-continue` not answered yet, reads paused
  by flow control), and it starts again when the response before a waiting request ends.
- **An offer to upgrade the connection is declined, and the request served** as the HTTP/1.1 request it also is
  (RFC 9110 §7.8 lets a server ignore `Upgrade`): `Connection: Upgrade` with `Upgrade: h2c`, which curl --http2 and
  Java's HttpClient send on http:// URLs, or `Upgrade: websocket` (the front serves no WebSockets). llhttp ends the
  message at the offer's headers and leaves the body unparsed (httptools#124, uvicorn#2722), so the app read an
  empty body (400, "not valid JSON") and uvicorn logged warnings about WebSocket libraries. The body is read here
  by its Content-Length, past the parser, and the connection closes after the response (what followed the body
  would be the offered protocol's); a chunked body with an offer is refused 400, naming the header to drop.
- **What the HTTP parser refuses** (a bad Content-Length, broken chunked framing, a control character in a header)
  is answered 400 in OpenAI's error shape with the parser's reason, where uvicorn sent plain text that named none;
  a failure of the protocol's own callbacks (a bug) is a 500 and an ERROR with its traceback. An answer never goes
  into another response: behind one still being sent it waits for that one's end, and a request answered already
  (the app refused it before reading its body) gets no second answer, its connection is only closed.

Refusals are counted by `refused` (colibri_openai:refused_total{status}), once: where the app waits for the body of
the request refused, it counts it (the request's scope holds `ENDED_BY_FRONT`, which `http_io.read_json` reads when
the body ends) and its own answer goes nowhere, the connection being closed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Callable
from http import HTTPStatus

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from colibri.openai_api.errors import ApiError

log = logging.getLogger("colibri.openai")
ENDED_BY_FRONT = "colibri.ended_by_front"        # scope key: the ApiError of a request whose body the front cut off


def answer(err: ApiError) -> bytes:
    """`err` as a whole response, bytes on the wire, that closes the connection (written by a protocol itself:
    these rules', head_limit's 431)."""
    body = json.dumps(err.body()).encode()
    reason = HTTPStatus(err.status).phrase.encode()
    return b"".join([b"HTTP/1.1 %d %s\r\n" % (err.status, reason), b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body])


def ruled_protocol(base: type[HttpToolsProtocol], read_timeout: float,
                   refused: Callable[[int], None]) -> type[HttpToolsProtocol]:
    """`base` (uvicorn's httptools protocol, or head_limit's) held to the rules above."""
    too_slow = ApiError(408, f"the request stopped coming: nothing arrived for {read_timeout:g} s before it was whole "
                             f"(the front's --request-read-timeout); send it at once", code="request_timeout")

    class Ruled(base):  # type: ignore[valid-type, misc]
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.reading = False                          # a request has begun and not all of it has come
            self.began = False                            # a request has begun on this connection
            self.broken = False                           # the parser refused the bytes: nothing more is read
            self.owed_answer: ApiError | None = None      # an answer waiting for the response being sent to end
            self.read_timer: asyncio.TimerHandle | None = None
            self.offer_body: int | None = None           # a declined upgrade's body bytes still to come
            self.offer_at: int | None = None             # where, in the read being parsed, the parser stopped at one
            self.prior_cycle = None                       # the cycle before the request being parsed

        # ------------------------------------------------------------------------------------ uvicorn's calls

        def connection_made(self, transport) -> None:     # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self.broken:
                return
            if self.offer_body is not None:               # a declined upgrade's body, read past the parser
                self._unset_keepalive_if_required()       # (uvicorn's keep-alive clock: the body is coming)
                self._offer_body(data)
            else:
                super().data_received(data)
                if self.offer_at is not None:             # the parser stopped at an offer: the rest is its body
                    rest, self.offer_at = data[self.offer_at:], None
                    if self.offer_body is not None and not self.transport.is_closing():
                        self._offer_body(rest)
            if self.transport.is_closing():
                self._disarm()
            else:
                self._arm()                               # the clock restarts with every read; _expired judges

        def on_message_begin(self) -> None:
            self.prior_cycle = self.cycle
            super().on_message_begin()
            self.reading = self.began = True

        def on_message_complete(self) -> None:
            if (self.parser.should_upgrade() and self.offer_body is None and self.cycle is not None
                    and self.cycle is not self.prior_cycle):      # (not where no cycle began: a refused head)
                self._decline_offer()                    # (llhttp's end of the message at an offer's headers)
                return
            super().on_message_complete()
            self.reading = False

        def _unsupported_upgrade_warning(self) -> None:
            """uvicorn's call inside `except HttpParserUpgrade`, for an offer it does not take: where the parser
            stopped, for data_received (no warning: the offer is declined, the request served)."""
            exc = sys.exc_info()[1]
            self.offer_at = exc.args[0] if isinstance(exc, httptools.HttpParserUpgrade) and exc.args else 0

        def on_response_complete(self) -> None:
            super().on_response_complete()                # (head_limit may answer its owed 431 and close here)
            if self.transport.is_closing():
                return
            if self.owed_answer is not None and not self._busy():
                self._send(self.owed_answer)
            elif self.reading:                            # a request waited behind that response: its clock,
                self._unset_keepalive_if_required()       # not uvicorn's keep-alive, and from now
                self._arm()

        def send_400_response(self, msg: str) -> None:
            if self.transport.is_closing():
                return
            self.broken = True
            exc = sys.exc_info()[1]                       # uvicorn calls this inside `except HttpParserError` only
            if isinstance(exc, httptools.HttpParserCallbackError):
                log.error("a request failed in the front's HTTP protocol", exc_info=exc.__context__)
                err = ApiError(500, "internal error in the front while it read the request")
            else:
                err = ApiError(400, f"the request is not valid HTTP/1.1{f' ({exc})' if exc else ''}: check its "
                                    f"request line, its headers and its body's length (Content-Length or chunked)",
                               code="invalid_http")
            self._end(err, "was not valid HTTP/1.1")

        # ------------------------------------------------------------------------------------ the rules

        def _decline_offer(self) -> None:
            """The request whose headers offered an upgrade: its body, by its Content-Length, is read past the
            parser (`_offer_body`); the connection ends with its response, once the body has come (closed with
            some of it unread, the kernel would reset the connection, and the response might not reach the
            client: an early answer, a 401, ends before the body)."""
            assert self.cycle is not None
            fields = dict(self.headers)
            if b"transfer-encoding" in fields:
                self.broken = True
                self._end(ApiError(400, "a request that offers to upgrade the connection (its Upgrade header) and "
                                        "sends a chunked body is not served: send it without the Upgrade header, "
                                        "or with a Content-Length", code="invalid_http"),
                          "offered an upgrade with a chunked body")
                return
            self.offer_body = int(fields.get(b"content-length", b"0"))   # (llhttp checked it is one number)
            if not self.offer_body:
                self._offer_body(b"")

        def _offer_body(self, data: bytes) -> None:
            """Bytes of a declined upgrade's body (none beyond it is read: the connection ends with the response)."""
            assert self.offer_body is not None and self.cycle is not None
            if self.offer_body < 0:
                return
            if self.offer_body > 0:
                part = data[:self.offer_body]
                self.offer_body -= len(part)
                if part:
                    self.on_body(part)
                if self.offer_body > 0:
                    return
            self.offer_body = -1                          # whole: what follows is dropped until the close
            self.cycle.keep_alive = False                 # (the response says so, if it has not begun)
            super().on_message_complete()
            self.reading = False
            if self.cycle.response_complete:              # answered before its body came: now it may close
                self.transport.close()

        def _busy(self) -> bool:
            """The front holds things up: a response is being sent, the body is not asked for yet (100-continue),
            or a pipelined request waits its turn."""
            c = self.cycle
            return bool(self.pipeline) or (c is not None and not c.response_complete and (
                not c.more_body or c.response_started or c.waiting_for_100_continue))

        def _end(self, err: ApiError, why: str) -> None:
            """Refuse the request being read with `err`, now or once the response being sent has ended."""
            c = self.cycle
            log.warning("refused a request from %s that %s: %d", self._who(), why, err.status)
            if c is not None and c.more_body and c.response_started:    # this request is answered, or being so
                if c.response_complete:
                    self.transport.close()
                else:
                    c.keep_alive = False                  # uvicorn closes the connection after that response
                return
            if c is not None and c.more_body and not c.response_complete:   # the app waits for its body
                c.scope[ENDED_BY_FRONT] = err             # type: ignore[literal-required]  (the app counts it)
                self.transport.write(answer(err))
                self.transport.close()
            elif self._busy():
                self.owed_answer = err                    # on_response_complete sends it
            else:
                self._send(err)

        def _who(self) -> str:
            return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"

        def _send(self, err: ApiError) -> None:
            refused(err.status)
            self.transport.write(answer(err))
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
            if self.transport.is_closing() or self.owed_answer is not None:
                return
            if self._busy() or self.flow.read_paused:
                self._arm()                               # the front holds things up, not the client
                return
            if self.reading:
                self.broken = True
                self._end(too_slow, f"stopped coming for {read_timeout:g}s (--request-read-timeout)")
                return
            if not self.began:                            # nothing begun, or blank lines: no request to answer
                refused(408)
                log.info("closed a connection from %s that sent no request in %gs (--request-read-timeout)",
                         self._who(), read_timeout)
            self.transport.close()                        # (else idle between requests, as uvicorn's keep-alive)

    return Ruled
