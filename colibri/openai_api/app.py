"""`colibri openai`: an OpenAI-compatible HTTP front, a stateless process that speaks gRPC to a router.

Starlette on uvicorn (httptools), chosen by measurement (benchmarks/results/http_frameworks.md): per streamed
event it costs what aiohttp does, and it cancels a stream within ~1 ms of the client leaving, which is what
aborts the request on the router and frees its KV cache.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (each streamed as server-sent events
or not), GET /health (200 when the router answers SERVING), GET /metrics (Prometheus). Before any of them, the
guard (guard.py): Host, CORS, API key, JSON bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator

import grpc
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from colibri.client import request_of
from colibri.openai_api.errors import ApiError, bad, without_addresses
from colibri.openai_api.guard import Guard
from colibri.openai_api.http_io import (
    CLIENT_GONE,
    OFF_LOOP_BYTES,
    EventStream,
    disconnected,
    merge,
    off_loop_if,
    read_json,
)
from colibri.openai_api.metrics import FrontMetrics
from colibri.openai_api.options import OpenAIOptions
from colibri.openai_api.policy import Policy
from colibri.openai_api.protocol import (
    COMPLETION_MAX_TOKENS,
    Parsed,
    check_model,
    check_text,
    parse_chat,
    parse_completion,
    request_id_of,
)
from colibri.openai_api.responses import Reply, sse
from colibri.openai_api.router_link import RouterLink
from colibri_common.chat_template import ChatTemplate, TemplateBroken, TemplateError
from colibri_common.errors import DRAINING_MARK
from colibri_common.pb import generation_pb2 as pb
from colibri_common.repeated_log import RepeatedLog

log = logging.getLogger("colibri.openai")
ROUTER_SERVICE = "colibri.v1.Generation"
DONE = "[DONE]"
ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")   # (404's list)
KEEPALIVE = b": keep-alive\n\n"   # an SSE comment: clients skip it (OpenAI's SDK, EventSource)
HTTP10_STREAM = ("streaming needs HTTP/1.1 (server-sent events in chunked transfer encoding) and this request came "
                 "as HTTP/1.0: send it as HTTP/1.1 (behind nginx: proxy_http_version 1.1) or with \"stream\": false")


class Front:
    def __init__(self, opts: OpenAIOptions) -> None:
        self.opts = opts
        self.link = RouterLink(opts)          # the connection to the router (and a new one where it drains)
        self.metrics = FrontMetrics()
        self.hide = self.link.hide            # the router's address, kept out of what clients read (errors.py)
        self._info: pb.ModelInfoResponse | None = None
        self._unready = RepeatedLog(log, every_s=10.0, level=logging.WARNING)   # where and why, for the operator
        self._template: ChatTemplate | None = None
        self.started = int(time.time())

    # -- what the router serves -------------------------------------------------------------------------
    async def info(self) -> pb.ModelInfoResponse:
        """The router's ModelInfo, asked once (a router still loading is a 503 the client retries)."""
        if self._info is None:
            try:
                info = await self.link.client.model_info()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise ApiError.of_grpc(exc, self.hide) from None
                self._unready.say(exc.details() or "", f"the router at {self.opts.target} is not ready: "
                                                        f"{exc.details()}")
                why = without_addresses(exc.details() or "", self.hide)
                raise ApiError(503, f"the router is not ready: {why}") from None
            if self._info is not None:            # another request asked at the same time and got it first
                return self._info
            self._info = info
            self._unready.end()                   # how often it was not ready since last said, if it was held back
            if info.chat_template:
                self._template = ChatTemplate(info.chat_template, dict(info.special_tokens))
                if (why := self._template.broken()) is not None:
                    log.error("the model's chat template does not compile: %s; /v1/chat/completions answers 500 "
                              "until the checkpoint's template is fixed (/v1/completions is served)", why)
            log.info("serving %s (%s) from the router at %s as '%s'", info.model_path, info.architecture,
                     self.opts.target, self.model_name(info))
            if info.sampling_defaults and self.opts.generation_config == "auto":
                log.info("sampling defaults from the checkpoint's generation_config.json for requests that leave "
                         "them out: %s (--generation-config vllm: OpenAI's)",
                         ", ".join(f"{k} {v:g}" for k, v in sorted(info.sampling_defaults.items())))
        return self._info

    def model_name(self, info: pb.ModelInfoResponse) -> str:
        """--served-model-name, else the checkpoint directory's name (a router sends no more than the name)."""
        return self.opts.served_model_name or os.path.basename(info.model_path.rstrip("/")) or "colibri"

    async def health(self) -> bool:
        """Whether the router serves; where the one this front is connected to does not (draining, say), asked
        again on a new connection (redial), which behind a Service may reach another."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        for _ in range(2):
            client = self.link.client
            try:
                stub = health_pb2_grpc.HealthStub(client.channel)
                res = await stub.Check(health_pb2.HealthCheckRequest(service=ROUTER_SERVICE), timeout=2)
                if res.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            if not self.link.redial("the router it was connected to was not serving", client):
                return False
        return False

    # -- routes -----------------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        info = await self.info()
        name = self.model_name(info)         # the served name only: no path, no worker or router address
        card = {"id": name, "object": "model", "created": self.started, "owned_by": "colibri", "root": name,
                "max_model_len": info.max_model_len}
        if "model" in request.path_params:
            if request.path_params["model"] != card["id"]:
                raise ApiError(404, f"the model '{request.path_params['model']}' does not exist", "model",
                               "model_not_found")
            return JSONResponse(card)
        return JSONResponse({"object": "list", "data": [card]})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _generate(self, request: Request, chat: bool) -> Response:
        body, size = await read_json(request, self.opts.max_body_bytes)
        # a large body's parse and chat template run off the event loop: 120k messages held every other request
        # (and /health) for ~1 s
        off_loop = size > OFF_LOOP_BYTES
        parsed = await off_loop_if(off_loop, parse_chat if chat else parse_completion, body)
        request_id = request_id_of(request.headers.get("x-request-id"), body)
        if parsed.stream and request.scope["http_version"] == "1.0":     # uvicorn would answer it chunked
            raise bad(HTTP10_STREAM, "stream")
        info = await self.info()
        name = self.model_name(info)
        check_model(parsed, name)
        if self.opts.generation_config == "auto":
            parsed = parsed.with_defaults(dict(info.sampling_defaults))
        parsed.check_min_tokens(COMPLETION_MAX_TOKENS)
        prompts = [await off_loop_if(off_loop, self._render, parsed, info.has_tokenizer)] if chat else parsed.prompts
        if any(isinstance(p, str) for p in prompts) and not info.has_tokenizer:
            raise bad("this model has no tokenizer.json: send the prompt as token ids", "prompt")
        n = parsed.sampling.n or 1
        if info.max_waiting and len(prompts) * n > info.max_waiting:     # 429 'retry later' could never succeed
            raise bad(f"{len(prompts)} prompt(s) x n={n} = {len(prompts) * n} sequences exceed what the router "
                      f"queues at once ({info.max_waiting}, its --max-waiting): send fewer prompts or a lower n", "n")
        reply = Reply(chat, name, n, info.has_tokenizer,
                      parsed.sampling.logprobs or parsed.sampling.top_logprobs > 0, tuple(parsed.sampling.stop),
                      request_id)
        self.metrics.started(reply)             # in flight from here (queued on the router too), counted once
        calls: list = []
        try:
            first, streams = await self._first(request, reply, prompts, parsed, calls)
        except BaseException:                   # a refusal, or cancelled (the server stopping): counted once
            _cancel(calls)
            self.metrics.finished(reply, "abort")    # (a no-op where a status was counted before)
            raise
        if first is None:                       # the client left before its first token
            log.info("%s: the client went away before the first token; cancelled on the router", reply.call_id)
            return Response(status_code=499)
        messages = merge(streams, first)
        if parsed.stream:
            stream = EventStream(self._events(reply, messages, parsed.include_usage),
                                 on_close=lambda: self._close(reply, calls, "abort", quiet=stream.stalled),
                                 stall_s=self.opts.stream_stall_timeout, on_stall=lambda: log.warning(
                                     "%s: the client has read nothing of its stream for %gs: dropped, and its "
                                     "request cancelled on the router (--stream-stall-timeout)", reply.call_id,
                                     self.opts.stream_stall_timeout),
                                 headers={"X-Request-Id": reply.echoed_id})
            return stream
        try:
            return await self._whole(request, reply, messages, calls)
        finally:
            self._close(reply, calls, "error")

    async def _first(self, request: Request, reply: Reply, prompts: list, parsed: Parsed,
                     calls: list, retry: bool = True) -> tuple[list | None, list]:
        """Send every prompt to the router (into `calls`) and wait for each call's first message: the router's
        verdict on its prompt (a refusal is a status code, before any byte is sent). (None, streams) when the
        client left first (the calls are cancelled and counted as an abort); a refusal is raised as its ApiError,
        counted by its status. A router that drains refuses new calls on the connection it keeps: they are sent
        once more, on a new one (redial)."""
        client = self.link.client
        calls += [client.stream(request_of(p, parsed.sampling, f"{reply.call_id}-{i}", parsed.add_special_tokens),
                                self.opts.request_timeout)
                  for i, p in enumerate(prompts)]
        streams = [aiter(call) for call in calls]
        failed: list[int] = []          # the prompts the router refused, in the order their refusals came

        async def first(i: int, it: AsyncIterator[pb.GenerateResponse]) -> pb.GenerateResponse:
            try:
                return await anext(it)
            except grpc.RpcError:
                failed.append(i)        # before gather sees it: the first refusal gather raises is failed[0]
                raise

        firsts = asyncio.ensure_future(asyncio.gather(*(first(i, it) for i, it in enumerate(streams))))
        # read whatever it ends with, so a gather cancelled when the client left (it then holds CancelledError or
        # the cancelled calls' error) is not logged as "exception was never retrieved" with a traceback
        firsts.add_done_callback(lambda f: f.cancelled() or f.exception())
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({firsts, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            left = not firsts.done()
            if left:                            # the client left, or this handler was cancelled
                firsts.cancel()
        if left or (gone.done() and not gone.cancelled()):      # it left (or both at once)
            self._close(reply, calls, "abort", quiet=True)
            return None, streams
        try:
            return firsts.result(), streams
        except grpc.RpcError as exc:
            if retry and _draining(exc) and self.link.redial(exc.details() or "", client):
                _cancel(calls)                  # refused before any work: sent again on the new connection
                calls.clear()
                return await self._first(request, reply, prompts, parsed, calls, retry=False)
            err = ApiError.of_grpc(exc, self.hide, "messages" if reply.chat else "prompt")
            if len(prompts) > 1 and failed and err.param == "prompt":
                # which of the prompts, said at the end: a context length's message keeps OpenAI's opening
                err = ApiError(err.status, f"{err.message} (prompt {failed[0]} of {len(prompts)}, from 0)",
                               err.param, err.code)
            self._close(reply, calls, str(err.status))
            raise err from None
        except StopAsyncIteration:
            self._close(reply, calls, "500")
            raise ApiError(500, "the router ended a call without an answer") from None

    def _close(self, reply: Reply, calls: list, outcome: str, quiet: bool = False) -> None:
        """Every way out of a request: its router calls cancelled (a no-op once they ended), counted once."""
        _cancel(calls)
        if self.metrics.finished(reply, outcome) and outcome == "abort" and not quiet:   # a stream left mid-way
            log.info("%s: the client went away mid-stream; its request was cancelled on the router", reply.call_id)

    def _render(self, parsed: Parsed, has_tokenizer: bool) -> str:
        if self._template is None:
            raise bad("this model has no chat template (its tokenizer_config.json or chat_template.jinja has "
                      "none): use /v1/completions with the prompt as " + ("text" if has_tokenizer else
                      "token ids (it has no tokenizer.json either: the text of its answers is empty, and "
                      "logprobs name its tokens by id)"), "messages")
        try:
            text = self._template.render(parsed.messages, parsed.add_generation_prompt, parsed.template_kwargs)
        except TemplateError as exc:
            raise bad(str(exc), "messages") from None
        except TemplateBroken as exc:
            raise ApiError(500, str(exc), code="chat_template_broken") from None
        return check_text(text, "messages")

    async def _whole(self, request: Request, reply: Reply,
                     messages: AsyncIterator[tuple[int, pb.GenerateResponse]], calls: list) -> Response:
        """Collect the whole answer; a client that leaves first cancels the calls (the router frees the KV)."""

        async def collect() -> None:
            async for prompt, msg in messages:
                self._fold(reply, prompt, msg)

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():
            work.cancel()
            _cancel(calls)
            with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                await work
            log.info("%s: the client went away; its request was cancelled on the router", reply.call_id)
            self.metrics.finished(reply, "abort")
            return Response(status_code=499)
        try:
            work.result()
        except grpc.RpcError as exc:
            err = ApiError.of_grpc(exc, self.hide)
            self.metrics.finished(reply, str(err.status))
            raise err from None
        self.metrics.finished(reply, "ok")
        return JSONResponse(reply.body(), headers={"X-Request-Id": reply.echoed_id})

    def _fold(self, reply: Reply, prompt: int, msg: pb.GenerateResponse) -> tuple[int, str, list, str | None]:
        out = reply.add(prompt, msg)
        if msg.WhichOneof("response") == "chunk":
            self.metrics.tokens(len(msg.chunk.token_ids))
        return out

    async def _events(self, reply: Reply, messages: AsyncIterator[tuple[int, pb.GenerateResponse]],
                      include_usage: bool) -> AsyncIterator[bytes]:
        """The SSE stream. A client that leaves cancels this generator (CancelledError) or the response before
        it starts; `EventStream` then cancels the router calls, and the router frees the request's KV blocks."""
        every, quiet_since = self.opts.sse_keepalive, None
        try:
            async for prompt, msg in messages:
                chunk = reply.chunk(*self._fold(reply, prompt, msg), include_usage)
                if chunk is not None:
                    yield sse(chunk)
                    quiet_since = None
                elif every:                           # tokens with no text to send yet (a model without a
                    now = time.monotonic()            # tokenizer, a stop string's prefix held back): a comment
                    if quiet_since is None:           # line now and then keeps idle timeouts on the way from
                        quiet_since = now             # cutting a healthy stream
                    elif now - quiet_since >= every:
                        yield KEEPALIVE
                        quiet_since = now
            if include_usage:
                yield sse(reply.usage_chunk())
            self.metrics.finished(reply, "ok")
        except grpc.RpcError as exc:              # mid-stream: the status line is sent; the error goes as an event
            err = ApiError.of_grpc(exc, self.hide)
            self.metrics.finished(reply, str(err.status))
            yield sse(err.body())
        yield sse(DONE)

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def health_route(self, request: Request) -> Response:
        """Open to anyone (probes carry no key), so it names no address."""
        if await self.health():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)


def _draining(exc: grpc.RpcError) -> bool:
    """A refusal of a router that drains (no work done: the call may go to another router)."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and DRAINING_MARK in (exc.details() or "")


def _cancel(calls: list) -> None:
    for call in calls:
        call.cancel()


def build_app(front: Front, policy: Policy) -> Starlette:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        front.metrics.refused(exc.status)
        if exc.status == CLIENT_GONE:
            return Response(status_code=CLIENT_GONE)
        headers = exc.headers()
        with contextlib.suppress(ApiError):                          # a valid one is echoed, as on an answer
            if (given := request_id_of(request.headers.get("x-request-id"), None)) is not None:
                headers["X-Request-Id"] = given
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        """Starlette's own 404 (no such route) and 405 (wrong method), in OpenAI's shape."""
        assert isinstance(exc, HTTPException)
        path = request.url.path
        slash = f" (send {path.rstrip('/')}, without the trailing slash)" if path.rstrip("/") in ROUTES else ""
        what = {404: f"no route {path}{slash}; this server has {', '.join(ROUTES)}",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
        err = ApiError(exc.status_code, what)
        front.metrics.refused(exc.status_code)       # counted as the front's own refusals are (a 405 was not)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=dict(exc.headers or {}))

    async def internal(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
        front.metrics.refused(500)
        return JSONResponse(ApiError(500, f"internal error in the front: {exc!r}").body(), status_code=500)

    routes = [
        Route("/v1/models", front.models, methods=["GET"]),
        Route("/v1/models/{model:path}", front.models, methods=["GET"]),
        Route("/v1/completions", front.completions, methods=["POST"]),
        Route("/v1/chat/completions", front.chat, methods=["POST"]),
        Route("/health", front.health_route, methods=["GET"]),
        Route("/metrics", front.metrics_route, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={ApiError: api_error, HTTPException: http_error,
                                                       Exception: internal},
                    middleware=[Middleware(Guard, policy=policy, refused=front.metrics.refused)])
    app.router.redirect_slashes = False        # a POST to /v1/completions/ is a 404 that says so, not a bare 307
    return app
