"""The Python client of the Generation service: `Client` (blocking) and `AsyncClient` (asyncio), alike.

    from colibri.client import Client

    with Client("127.0.0.1:50051") as client:                 # tls_ca=... for a TLS router
        res = client.generate("The capital of France is", max_tokens=16, timeout=30)
        print(res.text, res.finish_reason)
        for delta in client.stream_text("Once upon a time", max_tokens=64, stop=("\\n",)):
            print(delta.text, end="", flush=True)

`generate` collects every choice of a request (`n`, `logprobs`, `stop`, penalties: every SamplingParams field
is a keyword); `stream_text` yields each piece as it comes; `abort(request_id)` ends an open request from
anywhere; `timeout` is the call's deadline in seconds. A failed call raises `GenerationError`, a
`grpc.RpcError` whose `code()` says what happened: INVALID_ARGUMENT (fix the request), RESOURCE_EXHAUSTED
(queue full: retry later), UNAVAILABLE (retry, possibly elsewhere), DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator

import grpc

from colibri.results import RETRYABLE as RETRYABLE  # noqa: PLC0414 (re-exported: callers import them from here)
from colibri.results import Choice as Choice  # noqa: PLC0414
from colibri.results import Delta, GenerationError, Result
from colibri_common.options import check_target
from colibri_common.pb import generation_pb2 as pb
from colibri_common.pb import generation_pb2_grpc
from colibri_common.serving import CHANNEL_OPTIONS, RECONNECT_OPTIONS, channel_options, grpc_timeout
from colibri_common.tls import client_channel

DEFAULT_TIMEOUT = 300.0
FLOAT32_TINY = 2.0**-149        # the smallest positive float32 (a subnormal)


def make_request(prompt: str | list[int], max_tokens: int = 0, temperature: float = 0.0, seed: int | None = None,
                 return_logits: bool = False, request_id: str = "", add_special_tokens: bool = True,
                 **sampling) -> pb.GenerateRequest:
    """A GenerateRequest; `sampling` takes any SamplingParams field (top_p, stop, n, logprobs, ...);
    `add_special_tokens`: as request_of."""
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = (sampling["stop"],)              # one stop string, not its characters
    fields = {"max_tokens": max_tokens, "temperature": temperature, "return_logits": return_logits,
              **{k: v for k, v in sampling.items() if v is not None}, **({} if seed is None else {"seed": seed})}
    if isinstance(fields.get("top_p"), float):
        fields["top_p"] = wire_top_p(fields["top_p"])
    return request_of(prompt, _message(pb.SamplingParams, fields), request_id, add_special_tokens)


def wire_top_p(top_p: float) -> float:
    """top_p as SamplingParams carries it (float32, where 0 is off): a positive value that float32 would round to 0
    goes as float32's smallest positive one, which keeps the likeliest token alone (1e-50 had sampled every token)."""
    return FLOAT32_TINY if 0.0 < top_p < FLOAT32_TINY else top_p


def _message(kind, fields: dict):
    """kind(**fields), where a value the message cannot carry (past its integer field's range, a string that is
    not Unicode, a wrong type) is a ValueError naming the field, not protobuf's bare 'Value out of range'."""
    try:
        return kind(**fields)
    except (ValueError, TypeError) as exc:
        for name, value in fields.items():
            try:
                kind(**{name: value})
            except (ValueError, TypeError) as one:
                raise ValueError(f"{name}={value!r:.80} cannot be sent: {_why(one)}") from None
        raise ValueError(f"the request cannot be sent: {_why(exc)}") from None


def _why(exc: Exception) -> str:
    if isinstance(exc, UnicodeEncodeError):
        return "it is not valid Unicode text (a lone surrogate?)"
    return str(exc).splitlines()[0]


class _ClientsTimeout(float):
    """The default of a call's `timeout`: the client's own. Told apart by identity, so no number a caller passes
    (-1 had meant this one) takes its place."""

    def __repr__(self) -> str:
        return "the client's timeout"


DEFAULT = _ClientsTimeout(-1.0)


def _seconds(value: object, name: str) -> float | None:
    """A deadline in seconds (> 0), or None for none (inf too: gRPC took it as one already passed); a ValueError or
    TypeError naming `name` otherwise (-5 had meant the default, nan an expired deadline, "5" a TypeError from
    inside gRPC)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be seconds (a number) or None for no deadline, got {value!r}")
    if not value > 0:
        raise ValueError(f"{name} must be seconds > 0, or None for no deadline, got {value!r}")
    return None if math.isinf(value) else float(value)


def _target(target: object) -> str:
    """The router's address as gRPC dials it; a port past 65535 (dialled modulo 65536) or an empty target is a
    ValueError, a non-string a TypeError."""
    if not isinstance(target, str):
        raise TypeError(f"target must be the router's address 'HOST:PORT' (a str), got {target!r}")
    if not target.strip():
        raise ValueError("target is empty: give the router's address HOST:PORT")
    check_target("target", target)
    return target


def check_utf8(prompt: str) -> str:
    """The prompt, or a ValueError where UTF-8 cannot carry it (a lone surrogate)."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the prompt is not valid UTF-8 text (character {exc.start} is {prompt[exc.start]!r}: "
                         f"a lone surrogate, or bytes that were not UTF-8 on a command line)") from None
    return prompt


def request_of(prompt: str | list[int], sampling: pb.SamplingParams, request_id: str = "",
               add_special_tokens: bool = True) -> pb.GenerateRequest:
    """A GenerateRequest of a text or token-id prompt with these SamplingParams (ValueError, naming it, for a value
    a request cannot carry: token ids past int32, text that is not Unicode; TypeError for bytes, which are neither).
    `add_special_tokens`: whether a text
    prompt's tokenizing adds the tokenizer's special tokens (a BOS), as transformers' tokenizer(text) does."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):     # iterable ints: it was sent as token ids
        raise TypeError("the prompt must be text (str) or token ids (a list of int), got bytes: decode them first")
    if isinstance(prompt, str):
        check_utf8(prompt)
        return _message(pb.GenerateRequest, {"request_id": request_id, "text": prompt, "sampling": sampling,
                                             "add_special_tokens": add_special_tokens})
    try:
        ids = pb.TokenIds(ids=prompt)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"prompt token ids cannot be sent: {_why(exc)} (ids are int32)") from None
    return _message(pb.GenerateRequest, {"request_id": request_id, "token_ids": ids, "sampling": sampling})


def _delta(msg: pb.GenerateResponse) -> Delta | None:
    kind = msg.WhichOneof("response")
    if kind == "chunk":
        return Delta(msg.chunk.index, msg.chunk.text, tuple(msg.chunk.token_ids))
    if kind == "complete":
        return Delta(msg.complete.index, "", (), msg.complete.finish_reason)
    return None


class _Calls:
    """What both clients share: the deadline a call takes, and the check that the client is open."""

    timeout: float | None
    closed: bool

    def _deadline(self, timeout: float | None) -> float | None:
        seconds = self.timeout if timeout is DEFAULT else _seconds(timeout, "timeout")
        return None if seconds is None else grpc_timeout(seconds)

    def _check_open(self) -> None:
        if self.closed:                              # a ValueError, as a closed file's (gRPC's: "Channel closed!")
            raise ValueError("this Client is closed")


class Client(_Calls):
    def __init__(self, target: str, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        """Plaintext, or TLS when `tls_ca` (the router's CA) is given; `tls_cert`/`tls_key` for a router that
        requires client certificates. `timeout` is every call's default deadline (None: none)."""
        self.timeout = _seconds(timeout, "timeout")
        self.closed = False
        self.channel = client_channel(_target(target), CHANNEL_OPTIONS + RECONNECT_OPTIONS, tls_ca, tls_cert, tls_key)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def stream(self, request: pb.GenerateRequest, timeout: float | None = DEFAULT) -> Iterator[pb.GenerateResponse]:
        """The raw response stream of one request (cancel it with `.cancel()` or let it go); raw grpc.RpcErrors."""
        self._check_open()
        return self.stub.Generate(request, timeout=self._deadline(timeout))

    def generate(self, prompt: str | list[int], max_tokens: int = 0, timeout: float | None = DEFAULT,
                 **sampling) -> Result:
        """One whole request; `max_tokens` 0 = as many as fit. Raises GenerationError."""
        res = Result()
        try:
            for msg in self.stream(make_request(prompt, max_tokens, **sampling), self._deadline(timeout)):
                res.add(msg)
        except grpc.RpcError as exc:
            raise GenerationError.of(exc) from None
        return res

    def stream_text(self, prompt: str | list[int], max_tokens: int = 0, timeout: float | None = DEFAULT,
                    **sampling) -> Iterator[Delta]:
        """Each piece as it comes. Leaving the loop early (break, an exception) cancels the request."""
        call = self.stream(make_request(prompt, max_tokens, **sampling), self._deadline(timeout))
        try:
            for msg in call:
                delta = _delta(msg)
                if delta is not None:
                    yield delta
        except grpc.RpcError as exc:
            raise GenerationError.of(exc) from None
        finally:
            call.cancel()

    def abort(self, request_id: str, timeout: float = 30.0) -> bool:
        """End the open request with this id (every choice); False when none is open."""
        self._check_open()
        try:
            return self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout).found
        except grpc.RpcError as exc:
            raise GenerationError.of(exc) from None

    def model_info(self, timeout: float = 30.0) -> pb.ModelInfoResponse:
        self._check_open()
        try:
            return self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise GenerationError.of(exc) from None

    def close(self) -> None:
        self.closed = True
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Calls):
    """`Client` for asyncio (grpc.aio): the same calls, awaited; streams are async iterators."""

    def __init__(self, target: str, tls_ca: str | None = None, tls_cert: str | None = None,
                 tls_key: str | None = None, timeout: float | None = DEFAULT_TIMEOUT,
                 options: list[tuple[str, object]] | None = None) -> None:
        self.timeout = _seconds(timeout, "timeout")
        self.closed = False
        merged = channel_options(CHANNEL_OPTIONS, RECONNECT_OPTIONS, options or [])
        self.channel = client_channel(_target(target), merged, tls_ca, tls_cert, tls_key, aio=True)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def stream(self, request: pb.GenerateRequest, timeout: float | None = DEFAULT):
        """The raw response call: iterate it with `async for`; `.cancel()` ends the request."""
        self._check_open()
        return self.stub.Generate(request, timeout=self._deadline(timeout))

    async def generate(self, prompt: str | list[int], max_tokens: int = 0, timeout: float | None = DEFAULT,
                       **sampling) -> Result:
        res = Result()
        try:
            async for msg in self.stream(make_request(prompt, max_tokens, **sampling), self._deadline(timeout)):
                res.add(msg)
        except grpc.RpcError as exc:
            raise GenerationError.of(exc) from None
        return res

    async def stream_text(self, prompt: str | list[int], max_tokens: int = 0, timeout: float | None = DEFAULT,
                          **sampling) -> AsyncIterator[Delta]:
        """Each piece as it comes. To stop early, leave an `async with contextlib.aclosing(...)` block (or
        `await gen.aclose()`): an async generator left by `break` alone is closed only when it is collected."""
        call = self.stream(make_request(prompt, max_tokens, **sampling), self._deadline(timeout))
        try:
            async for msg in call:
                delta = _delta(msg)
                if delta is not None:
                    yield delta
        except grpc.RpcError as exc:
            raise GenerationError.of(exc) from None
        finally:
            call.cancel()

    async def abort(self, request_id: str, timeout: float = 30.0) -> bool:
        self._check_open()
        try:
            return (await self.stub.Abort(pb.AbortRequest(request_id=request_id), timeout=timeout)).found
        except grpc.RpcError as exc:
            raise GenerationError.of(exc) from None

    async def model_info(self, timeout: float = 30.0) -> pb.ModelInfoResponse:
        self._check_open()
        try:
            return await self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise GenerationError.of(exc) from None

    async def close(self) -> None:
        self.closed = True
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
