"""The front's HTTP plumbing, below the routes: a request's JSON body read within its limit (parsed on a worker
thread when large), the router's streams of one request merged, a streamed response that always runs its cleanup,
and the wait for a client that leaves."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from starlette.requests import ClientDisconnect, Request
from starlette.responses import StreamingResponse

from colibri.openai_api.connection_rules import ENDED_BY_FRONT
from colibri.openai_api.errors import ApiError, bad
from colibri_common.pb import generation_pb2 as pb

CLIENT_GONE = 499          # nginx's "client closed request": nobody reads it, the metrics count it


class _Unfinished:
    """Responses ended unfinished on purpose (a stalled client's), for server.py's filter of uvicorn's ERROR: that
    many of its lines are ours; any other is a bug's and is logged."""

    def __init__(self) -> None:
        self.pending = 0

    def add(self) -> None:
        self.pending += 1

    def take(self) -> bool:
        if self.pending <= 0:
            return False
        self.pending -= 1
        return True


UNFINISHED = _Unfinished()                     # one event loop: no lock


def _json(data: bytes) -> object:
    """The body as JSON text in UTF-8 (RFC 8259), a leading byte-order mark allowed."""
    return json.loads(data.decode("utf-8-sig"))


async def disconnected(request: Request) -> None:
    """Returns when the client closes its connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def merge(streams: list, firsts: list) -> AsyncIterator[tuple[int, pb.GenerateResponse]]:
    """(prompt index, message) from every call as they come, each call's first message first; one call is read
    directly. The queue is bounded, so a slow HTTP client slows the router's streams (its stall watch sees it)."""
    for i, msg in enumerate(firsts):
        yield i, msg
    if len(streams) == 1:
        async for msg in streams[0]:
            yield 0, msg
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=4 * len(streams))
    end = object()

    async def pump(i: int, stream: Any) -> None:
        try:
            async for msg in stream:
                await queue.put((i, msg))
            await queue.put((i, end))
        except grpc.RpcError as exc:
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
    left = len(streams)
    try:
        while left:
            i, item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, grpc.RpcError):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class EventStream(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends: done, failed, or cancelled by a client that
    left (even before the body iterator started, when the generator's own `finally` would never run). A write
    that waits `stall_s` on a client that reads nothing (its socket's buffers full) ends the response: `on_stall`
    says so, and `on_close` cancels its request on the router (the handler waited on that write for good)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], stall_s: float = 0.0,
                 on_stall: Callable[[], None] = lambda: None, headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                            **(headers or {})})
        self.on_close, self.stall_s, self.on_stall = on_close, stall_s, on_stall
        self._writing_since: float | None = None      # loop time of the write under way
        self.stalled = False                          # ended by `stall_s`

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None

        async def timed(message: Any) -> None:
            self._writing_since = loop.time()
            try:
                await send(message)
            finally:
                self._writing_since = None

        watch: asyncio.TimerHandle | None = None

        def check() -> None:                            # a timer, not a timeout per write (a task per event)
            nonlocal watch
            since = self._writing_since
            if since is not None and loop.time() - since >= self.stall_s:
                self.stalled = True
                task.cancel()
            else:
                watch = loop.call_later(min(1.0, self.stall_s / 4), check)

        if self.stall_s > 0:
            watch = loop.call_later(min(1.0, self.stall_s / 4), check)
        try:
            await super().__call__(scope, receive, timed)
        except asyncio.CancelledError:
            if not self.stalled:
                raise
            task.uncancel()
            UNFINISHED.add()                            # uvicorn's "returned without completing response" is ours
            self.on_stall()
        finally:
            if watch is not None:
                watch.cancel()
            self.on_close()


T = TypeVar("T")
OFF_LOOP_BYTES = 256 << 10      # bodies above this are decoded, parsed and templated on a worker thread


async def off_loop_if(off_loop: bool, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), on a worker thread where `off_loop` (a large request's CPU work), else right here."""
    return await asyncio.to_thread(fn, *args) if off_loop else fn(*args)


async def read_json(request: Request, limit: int) -> tuple[Any, int]:
    """(the body as JSON, its bytes), read up to `limit` bytes (413 beyond it, before anything is parsed)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body has {length} bytes, over the front's --max-body-bytes {limit}")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, f"the request body is over the front's --max-body-bytes {limit}")
            chunks.append(chunk)
    except ClientDisconnect:
        ended = request.scope.get(ENDED_BY_FRONT)   # cut off by the front (connection_rules), which answered it
        if ended is not None:
            raise ended from None
        raise ApiError(CLIENT_GONE, "the client went away while sending its request") from None
    data = b"".join(chunks)
    try:
        return await off_loop_if(size > OFF_LOOP_BYTES, _json, data), size
    except UnicodeDecodeError as exc:               # (json.loads would guess UTF-16 from some bytes, and say less)
        raise bad(f"the request body is not UTF-8, which JSON on the wire must be: {exc.reason} at byte "
                  f"{exc.start}") from None
    except RecursionError:
        raise bad("the request body is not valid JSON here: it nests arrays or objects too deep") from None
    except ValueError as exc:                       # bad JSON or UTF-8, a 5000-digit integer
        why = f"an integer of more than {sys.get_int_max_str_digits()} digits" \
            if "integer string conversion" in str(exc) else str(exc)
        raise bad(f"the request body is not valid JSON: {why}") from None
