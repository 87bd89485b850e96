"""A bound on a request's head (its request line and headers), as nginx's large_client_header_buffers and h11's
16 KiB: uvicorn's httptools protocol keeps every byte of a head it has not finished parsing, and takes a head of
any size, so one client could hold a connection's memory growing without end, before any key is asked for.

`bounded_protocol(max_bytes, refused)` is uvicorn's httptools protocol with that bound: a head longer than
`max_bytes` (--max-header-bytes) is answered 431 (OpenAI's error shape, `connection: close`), counted by `refused`,
and the connection closed; nothing after it on the connection is read. Two checks, one exact and one early:
- the head's own bytes when it is complete: the request line's target, and each header's name and value with its
  separators;
- while it is still coming, the bytes received since the read in which it began (that read is not counted: it may
  hold the end of the request before, body and all), so a head that never ends is refused once that many have come
  and holds at most `max_bytes` and one read (256 KiB).
A request pipelined behind others on the connection gets its 431 after their answers, in order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from colibri.openai_api.connection_rules import answer
from colibri.openai_api.errors import ApiError

log = logging.getLogger("colibri.openai")
STATUS = 431


def refusal(max_bytes: int) -> bytes:
    """The whole 431 response, bytes on the wire."""
    return answer(ApiError(STATUS, f"the request's headers are longer than this front takes ({max_bytes} bytes with "
                                   f"the request line, --max-header-bytes); send shorter ones",
                           code="headers_too_large"))


def bounded_protocol(max_bytes: int, refused: Callable[[int], None]) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol that answers 431 to a head over `max_bytes` (see the module's docstring)."""

    class BoundedHead(HttpToolsProtocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.in_head = False          # between a message's first byte and the end of its headers
            self.head_bytes = 0           # its head's own bytes so far (target, names, values, separators)
            self.received = 0             # bytes received in the reads after the one in which it began
            self.began_here = False       # it began in the read being parsed
            self.done = False             # refused: nothing more is parsed or started
            self.owed = False             # the 431 waits for the answers to the requests before it

        def data_received(self, data: bytes) -> None:
            if self.done:
                return
            super().data_received(data)
            if self.done or self.transport.is_closing():   # refused, or uvicorn answered a malformed head (400)
                return
            if self.in_head:
                if self.began_here:
                    self.began_here = False
                else:
                    self.received += len(data)
                if self.received > max_bytes:
                    self.refuse()

        def on_message_begin(self) -> None:
            if self.done:
                return
            super().on_message_begin()
            self.in_head, self.head_bytes, self.received, self.began_here = True, 0, 0, True

        def on_url(self, url: bytes) -> None:
            if self.done:
                return
            super().on_url(url)
            self.head_bytes += len(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if self.done:
                return
            super().on_header(name, value)
            self.head_bytes += len(name) + len(value) + 4            # ": " and CRLF

        def on_headers_complete(self) -> None:
            if self.done:
                return
            self.in_head = False
            if self.head_bytes > max_bytes:
                self.refuse()
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self.done:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self.done:
                super().on_message_complete()

        def refuse(self) -> None:
            """Counted and logged now; answered now, or after the answers to the requests before it."""
            self.done = True
            refused(STATUS)
            prefix = f"{self.client[0]}:{self.client[1]} - " if self.client else ""
            log.warning("%srefused a request whose head is over %d bytes (431)", prefix, max_bytes)
            if (self.cycle is not None and not self.cycle.response_complete) or self.pipeline:
                self.owed = True
            else:
                self.answer()

        def answer(self) -> None:
            if not self.transport.is_closing():
                self.transport.write(refusal(max_bytes))
                self.transport.close()

        def on_response_complete(self) -> None:
            if self.owed and not self.pipeline:           # the last request before the refused one is answered
                self.server_state.total_requests += 1
                self.owed = False
                self.answer()
                return
            super().on_response_complete()

    return BoundedHead
