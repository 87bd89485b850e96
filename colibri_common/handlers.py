"""gRPC method handlers built from a service's descriptor, so a malformed message is the caller's error.

grpcio's generated `add_*Servicer_to_server` decodes requests with `FromString` inside grpc: a message that
does not parse (invalid UTF-8 in a string field, truncated bytes) ends INTERNAL "Exception deserializing
request", which tells the caller nothing and reads as our bug. Here the decoder catches the parse error and
the call ends INVALID_ARGUMENT with what was wrong; in a client stream the bad message ends the stream.

`limits` caps concurrent calls per method: beyond the cap a call ends RESOURCE_EXHAUSTED at once, so
long-lived calls (an idle ForwardStream, a Generate whose client never reads) cannot take every thread of
the server's pool and leave health checks waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError


class Malformed:
    """What the decoder hands on for bytes that are not a valid message."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.message = f"the request is not a valid {type_name} message ({error}); check the client's encoding " \
                       f"(strings must be UTF-8)"


def _decoder(cls: Any) -> Callable[[bytes], Any]:
    def decode(data: bytes) -> Any:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, UnicodeDecodeError) as exc:
            return Malformed(cls.DESCRIPTOR.full_name, exc)
    return decode


def _checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    for r in requests:
        if isinstance(r, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, r.message)
        yield r


class _Cap:
    def __init__(self, method: str, limit: int) -> None:
        self.method, self.limit, self.n = method, limit, 0
        self.lock = threading.Lock()

    def enter(self, context: grpc.ServicerContext) -> None:
        with self.lock:
            if self.n >= self.limit:
                full = True
            else:
                self.n, full = self.n + 1, False
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.method}: {self.limit} calls are open already, the most this server takes at "
                          f"once; retry later or on another replica")

    def leave(self) -> None:
        with self.lock:
            self.n -= 1


def _wrap(behaviour: Callable, client_streaming: bool, server_streaming: bool, cap: _Cap | None) -> Callable:
    def admit(request: Any, context: grpc.ServicerContext) -> Any:
        if client_streaming:
            return _checked(request, context)
        if isinstance(request, Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return request

    if server_streaming:
        def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            if cap is not None:
                cap.enter(context)
            try:
                yield from behaviour(admit(request, context), context)
            finally:
                if cap is not None:
                    cap.leave()
        return streaming

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        if cap is not None:
            cap.enter(context)
        try:
            return behaviour(admit(request, context), context)
        finally:
            if cap is not None:
                cap.leave()
    return unary


def add_servicer(server: grpc.Server, servicer: object, service: ServiceDescriptor,
                 limits: dict[str, int] | None = None) -> None:
    """Register every method of `service` (implemented by `servicer`) with safe decoding and caps."""
    handlers = {}
    for m in service.methods:
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        cap = _Cap(m.name, limits[m.name]) if limits and m.name in limits else None
        fn = _wrap(getattr(servicer, m.name), m.client_streaming, m.server_streaming, cap)
        make = {(False, False): grpc.unary_unary_rpc_method_handler,
                (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = make(fn, request_deserializer=_decoder(req_cls),
                                response_serializer=resp_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
