"""The front's HTTP protocol rules (colibri/openai_api/connection_rules.py) on uvicorn with a real socket, under a small
app whose routes answer at once, after a pause, or before reading the body, so each rule is met at a known moment:
the read timeout (nothing sent, blank lines, a head or body that stops, pieces that keep coming, a request waiting
behind a slow response or an `Expect: 100-continue`) and the parser's refusals (never inside another response)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from colibri.openai_api.connection_rules import ruled_protocol
from colibri.openai_api.errors import ApiError
from colibri.openai_api.head_limit import bounded_protocol
from colibri.openai_api.http_io import read_json

TIMEOUT = 0.5          # --request-read-timeout here
SLOW = 1.5             # /slow's answer comes after this: three timeouts


def build(counted: list[int]) -> Starlette:
    async def echo(request: Request) -> Response:
        body, size = await read_json(request, 1 << 20)
        return JSONResponse({"size": size})

    async def slow(request: Request) -> Response:
        await asyncio.sleep(SLOW)
        return JSONResponse({"slow": True})

    async def early(request: Request) -> Response:         # answers before reading the body, as the guard's 401
        return JSONResponse({"refused": True}, status_code=401)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        counted.append(exc.status)                          # as the front's handler counts
        return JSONResponse(exc.body(), status_code=exc.status)

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/slow", slow, methods=["GET"]),
                             Route("/early", early, methods=["POST"])], exception_handlers={ApiError: api_error})


@contextmanager
def serving():
    """The app on uvicorn with the front's protocol (head bound, then these rules): (port, statuses counted)."""
    counted: list[int] = []
    protocol = ruled_protocol(bounded_protocol(4096, counted.append), TIMEOUT, counted.append)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = uvicorn.Server(uvicorn.Config(build(counted), http=protocol, ws="none", loop="asyncio", lifespan="off",
                                           log_config=None, access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1], counted
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def front():
    with serving() as got:
        yield got


def talk(port: int, *pieces: bytes, pause: float = 0.0) -> tuple[float, bytes]:
    """Send the pieces `pause` apart, read to the close: (seconds from connecting to the close, bytes read)."""
    t0, got = time.monotonic(), b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        for piece in pieces:
            s.sendall(piece)
            time.sleep(pause)
        while chunk := s.recv(1 << 16):
            got += chunk
    return time.monotonic() - t0, got


def post(path: str, body: bytes, length: int | None = None, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n").encode() + body


SLOW_GET = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"


def statuses(got: bytes) -> list[int]:
    return [int(s) for s in re.findall(rb"HTTP/1\.1 (\d{3}) ", got)]


def error(got: bytes, at: int = -1) -> dict:
    return json.loads(re.split(rb"HTTP/1\.1 \d{3} ", got)[at].partition(b"\r\n\r\n")[2])["error"]


def counting(counted: list[int]):
    """The statuses counted from now on, read once `expect` many have come (the app counts after the close) or 5 s
    have passed."""
    n = len(counted)

    def new(expect: int) -> list[int]:
        deadline = time.monotonic() + 5
        while len(counted) - n < expect and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)                              # and no more than that
        return counted[n:]
    return new


def test_a_connection_that_sends_nothing_or_blank_lines_is_closed(front):
    port, counted = front
    new = counting(counted)
    for pieces in ((), (b"\r\n",), (b"\r\n", b"\r\n")):
        waited, got = talk(port, *pieces, pause=0.2)
        assert got == b"" and TIMEOUT <= waited < 10, (pieces, waited, got)
    assert new(3) == [408, 408, 408]


def test_a_head_or_a_body_that_stops_coming_is_408_and_counted_once(front):
    port, counted = front
    new = counting(counted)
    full = json.dumps({"a": 1}).encode()
    for partial in (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Ty", post("/echo", full[:3], length=len(full))):
        waited, got = talk(port, partial)
        assert statuses(got) == [408] and error(got)["code"] == "request_timeout" and waited < 10, got[:300]
    assert new(2) == [408, 408]                        # the body's counted by the app (its scope says why)


def test_a_request_that_keeps_coming_in_pieces_is_served(front):
    port, _ = front
    whole = post("/echo", json.dumps({"pad": "p" * 200}).encode(), extra="Connection: close\r\n")
    waited, got = talk(port, *(whole[i:i + 30] for i in range(0, len(whole), 30)), pause=TIMEOUT / 5)
    assert statuses(got) == [200] and waited > TIMEOUT, got[:300]


def test_a_request_waiting_behind_a_slow_response_is_not_timed_until_that_response_ends(front):
    """A partial head pipelined behind a response that takes three timeouts: the response comes whole, then the 408,
    a timeout after it (uvicorn's keep-alive, 5 s, would have closed it silently); an `Expect: 100-continue`
    request behind it gets its 100 after that response and is served, its body sent then."""
    port, counted = front
    new = counting(counted)
    waited, got = talk(port, SLOW_GET + b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Par")
    assert statuses(got) == [200, 408] and SLOW + TIMEOUT <= waited < SLOW + 5, (waited, got[:300])
    assert new(1) == [408]
    body = json.dumps({"b": 2}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(SLOW_GET + post("/echo", b"", length=len(body), extra="Expect: 100-continue\r\n"))
        got = b""
        while b"100 Continue" not in got:
            got += s.recv(1 << 16)
        s.sendall(body)
        s.shutdown(socket.SHUT_WR)
        while chunk := s.recv(1 << 16):
            got += chunk
    assert statuses(got) == [200, 100, 200], got[:400]


def test_what_the_parser_refuses_is_a_json_400_after_the_response_before_it_and_counted_once(front):
    port, counted = front
    new = counting(counted)
    _, got = talk(port, post("/echo", b"{}", extra="Transfer-Encoding: chunked\r\n"))       # both framings: refused
    assert statuses(got) == [400] and error(got)["code"] == "invalid_http", got[:300]
    waited, got = talk(port, SLOW_GET + b"G\x01T / HTTP/1.1\r\n\r\n")                   # garbage behind /slow
    assert statuses(got) == [200, 400] and waited >= SLOW, got[:400]
    assert error(got)["message"].startswith("the request is not valid HTTP/1.1 (")
    chunked = (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"2\r\n{}\r\nzz\r\n")                                                        # the body's framing breaks
    _, got = talk(port, chunked)
    assert statuses(got) == [400] and error(got)["code"] == "invalid_http", got[:300]
    assert new(3) == [400, 400, 400]


def test_a_request_answered_before_its_body_gets_no_second_answer(front):
    """/early answers 401 without reading the body; the body then stops (or breaks): the connection is closed,
    with no 408 or 400 after the 401."""
    port, _ = front
    for tail in (b"{\"a\"", b"{\"a\"" + b"\r\nG\x01T / HTTP/1.1\r\n\r\n"):
        waited, got = talk(port, post("/early", tail, length=100))
        assert statuses(got) == [401] and waited < 10, got[:300]


H2C = "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"


@pytest.mark.parametrize("offer", [H2C, "Connection: keep-alive, Upgrade\r\nUpgrade: websocket\r\n"])
def test_an_offer_to_upgrade_is_declined_and_the_request_served_with_its_body(front, offer, caplog):
    """curl --http2 and Java's HttpClient offer h2c on http:// URLs: the body was lost under the offer (llhttp stops
    at it), the app read none (400, not valid JSON) and uvicorn logged warnings about WebSocket libraries. Now the
    request is served, its body whole, whether it came with the head or after it, and the connection closes after
    the response; a chunked body with an offer is refused, naming the header."""
    port, counted = front
    body = json.dumps({"pad": "q" * 300}).encode()
    whole = post("/echo", body, extra=offer)
    for pieces in ((whole,), (whole[:-len(body)], body[:100], body[100:]), tuple(whole[i:i + 50]
                                                                              for i in range(0, len(whole), 50))):
        waited, got = talk(port, *pieces, *[b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"], pause=0.05)
        assert statuses(got) == [200], got[:400]                     # and nothing after the body is served
        head, _, answer = got.partition(b"\r\n\r\n")
        assert json.loads(answer) == {"size": len(body)} and b"connection: close" in head.lower(), got[:400]
    _, got = talk(port, f"GET /slow HTTP/1.1\r\nHost: x\r\n{offer}\r\n".encode())
    assert statuses(got) == [200], got[:300]
    # answered before its body came (/early, as the guard's 401): the connection closes once the body is in, so
    # the answer is not lost to a reset
    early = post("/early", body, extra=offer)
    waited, got = talk(port, early[:-len(body)], body[:10], body[10:], pause=0.3)
    assert statuses(got) == [401] and waited >= 0.6, (waited, got[:300])
    new = counting(counted)
    _, got = talk(port, post("/echo", b"", extra=offer).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
                  + b"2\r\n{}\r\n0\r\n\r\n")
    assert statuses(got) == [400] and "without the Upgrade header" in error(got)["message"], got[:300]
    assert new(1) == [400]
    assert not [r for r in caplog.records if "upgrade" in r.getMessage().lower() and r.levelname != "WARNING"
                or "WebSocket" in r.getMessage()]
