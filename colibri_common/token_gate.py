"""The fleet token on the wire (colibri_common/fleet_token.py says where it comes from): `TokenGate` on a worker
refuses calls without it before it reads them, `with_token` on a router's channel adds it to every call."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

import grpc

from colibri_common.fleet_token import ENV

KEY = "authorization"
OPEN = ("/grpc.health.v1.Health/",)       # probes and the router's readiness checks need no token


def _refuse(request: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "this service takes calls from its own fleet only: the call "
                  f"carries no valid fleet token (${ENV})")


def _closed(request: Any, context: grpc.ServicerContext) -> None:
    context.abort(grpc.StatusCode.PERMISSION_DENIED, "this router's admin service is off: it has no fleet token. "
                  f"Start it with ${ENV} set (`colibri serve` passes its own) and call with the same token")


class TokenGate(grpc.ServerInterceptor):
    """Calls without `Bearer <token>` end UNAUTHENTICATED at once. The refusal is a stream-stream handler that
    never iterates its requests, so not one message of the caller is read, whatever the method.

    `guarded`: only methods under these prefixes are checked (a router's Admin service beside its open client
    API); with no token those are refused outright (PERMISSION_DENIED). `serves` (service name, what it is): a
    call to another service is UNIMPLEMENTED, saying what answered (a client pointed at an expert worker's port
    was told its fleet token was wrong)."""

    def __init__(self, token: str | None, guarded: tuple[str, ...] | None = None,
                 serves: tuple[str, str] | None = None) -> None:
        self._want = None if token is None else f"Bearer {token}".encode()
        self._guarded = guarded
        self._deny = grpc.stream_stream_rpc_method_handler(_refuse if token is not None else _closed)
        self._serves = serves
        self._served = () if serves is None else (f"/{serves[0]}/", "/grpc.reflection.")   # prefixes it answers

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method.startswith(OPEN):
            return continuation(details)
        if self._serves is not None and not details.method.startswith(self._served):
            name, what = self._serves
            message = f"{details.method}: this port serves {name} ({what}), not that service"

            def elsewhere(request: Any, context: grpc.ServicerContext) -> None:
                context.abort(grpc.StatusCode.UNIMPLEMENTED, message)

            return grpc.stream_stream_rpc_method_handler(elsewhere)
        if self._guarded is not None and not details.method.startswith(self._guarded):
            return continuation(details)
        if self._want is None:
            return self._deny
        given = next((v for k, v in details.invocation_metadata if k == KEY), "")
        given = given.encode() if isinstance(given, str) else given
        if hmac.compare_digest(given, self._want):
            return continuation(details)
        return self._deny


class _Details(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: list[tuple[str, str]]) -> None:
        self.method, self.timeout, self.credentials = base.method, base.timeout, base.credentials
        self.wait_for_ready, self.compression = base.wait_for_ready, base.compression
        self.metadata = metadata


class _WithToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.header = (KEY, f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _Details(details, [*(details.metadata or ()), self.header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


def with_token(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """`channel` whose every call carries the fleet token (the channel itself when there is none)."""
    return channel if token is None else grpc.intercept_channel(channel, _WithToken(token))
