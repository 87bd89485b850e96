"""Errors in OpenAI's JSON shape, with the HTTP codes the OpenAI clients act on.

The official clients raise by status (400 BadRequestError, 404 NotFoundError, 429 RateLimitError, 5xx
InternalServerError) and retry 408, 409, 429 and 5xx by themselves, honouring `Retry-After`. So a bad request is
400 (never retried), a full queue 429 and a router not ready or gone 503 (retried), a deadline 504.
"""

from __future__ import annotations

import re
from typing import Any

import grpc

from colibri_common.errors import CONTEXT_LENGTH_MARK, TOO_LARGE_HINT, TOO_LARGE_MARK
from colibri_common.pb import generation_pb2 as pb

HTTP_OF = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNIMPLEMENTED: 502,        # --target is not a router (an expert worker's port): a bad gateway
}
TYPE_OF = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
           404: "not_found_error", 405: "invalid_request_error", 408: "timeout", 409: "conflict_error",
           413: "invalid_request_error",
           415: "invalid_request_error",
           421: "invalid_request_error", 429: "rate_limit_error", 431: "invalid_request_error",
           502: "bad_gateway", 503: "service_unavailable",
           504: "timeout"}
# `code` where an error has no more particular one: the gRPC status's name where the router's refusals of the same
# kind carry it (a 400 of the front's own and one of the router's read alike), else the status's meaning
CODE_OF = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
           405: "method_not_allowed", 408: "request_timeout", 409: "already_exists", 413: "request_too_large",
           415: "unsupported_media_type", 421: "misdirected_request", 429: "resource_exhausted",
           431: "headers_too_large", 499: "cancelled", 500: "internal", 502: "bad_gateway", 503: "unavailable",
           504: "deadline_exceeded"}
RETRY_AFTER_S = {429: 1, 503: 1}
# Addresses inside the fleet as the router and gRPC word their errors: gRPC's own URIs ("ipv4:10.0.0.7:50052",
# "ipv6:%5B::1%5D:1", "unix:/run/w.sock"), what follows "expert worker " and "unreachable on " (a worker's address,
# its same-host socket) and a "(down: ...)" list, IP:port, [IPv6]:port and socket paths; the front adds its own
# --target literally. HTTP clients get none of them (docs/api.md); the logs keep them for the operators. Words in
# general are left alone (a "host:port" rule took times and model names such as "gpt-4.1:20" for addresses).
_ADDRESS = re.compile("|".join((
    r"\b(?:ipv4|ipv6|unix|unix-abstract|dns|vsock):[^\s,;()'\"]*[^\s,;()'\":]",
    r"(?<=expert worker )\S*[^\s:,;]", r"(?<=unreachable on )\S*[^\s:,;]", r"(?<=\(down: )[^)]+",
    r"\b\d{1,3}(?:\.\d{1,3}){3}:\d{1,5}\b", r"\[[0-9A-Fa-f.%]*:[0-9A-Fa-f:.%]*\](?::\d{1,5})?",
    r"%5B[0-9A-Fa-f.%]*:[0-9A-Fa-f:.%]*%5D(?::\d{1,5})?",
    r"(?:\bunix:)?/[^\s:,;()'\"]+\.sock\b")))
FLEET_ADDRESS = "<fleet address>"
MAX_SCRUBBED = 4000          # characters of a message looked at (and passed on): linear, whatever the router says


def without_addresses(text: str, also: tuple[str, ...] = ()) -> str:
    """`text` with every address of the fleet it names (and the literal strings `also`) replaced: what an HTTP
    client may read."""
    text = _ADDRESS.sub(FLEET_ADDRESS, text[:MAX_SCRUBBED])
    for literal in also:
        if literal:
            text = text.replace(literal, FLEET_ADDRESS)
    return text


class ApiError(Exception):
    """An error answer: HTTP status, message, and the request field it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPE_OF.get(self.status, "server_error"),
                          "param": self.param, "code": self.code or CODE_OF.get(self.status, "internal")}}

    def headers(self) -> dict[str, str]:
        wait = RETRY_AFTER_S.get(self.status)
        return {"Retry-After": str(wait)} if wait else {}

    @staticmethod
    def of_grpc(exc: grpc.RpcError, hide: tuple[str, ...] = (), prompt_param: str | None = None) -> ApiError:
        """The HTTP answer to a gRPC error, its message without the fleet's addresses (and the strings `hide`). A
        request over the model's length is OpenAI's `context_length_exceeded`, about `prompt_param`."""
        code = exc.code() if hasattr(exc, "code") else None
        details = without_addresses(exc.details() if hasattr(exc, "details") else str(exc), hide)
        if code is None:
            return ApiError(500, f"the router failed: {details}")
        if code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith(CONTEXT_LENGTH_MARK):
            return ApiError(400, details, prompt_param, "context_length_exceeded")
        status = HTTP_OF.get(code, 500)
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            return ApiError(400, details or code.name, param_of(details, prompt_param), code=code.name.lower())
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED and TOO_LARGE_MARK in details:
            status = 413         # gRPC's message-size limit: the request is too big, retrying cannot help
            details += TOO_LARGE_HINT
        if code is grpc.StatusCode.UNAVAILABLE and not details:
            details = "the router is not reachable"
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:     # gRPC's own text was "Stream removed (Deadline Exceeded)"
            details = f"the request did not finish within the front's --request-timeout ({details or code.name})"
        return ApiError(status, details or code.name, code=code.name.lower())


# the sampling fields a client sends (default_max_tokens is the front's own, from generation_config.json)
SAMPLING_FIELDS = frozenset(pb.SamplingParams.DESCRIPTOR.fields_by_name) - {"default_max_tokens"}


def param_of(details: str, prompt_param: str | None) -> str | None:
    """The request field a router's INVALID_ARGUMENT is about (OpenAI's `param`), read from its message, which names
    it first: the prompt (its token ids, its text, its length), the stop strings, or a sampling field by name."""
    if details.startswith(("token ids", "the prompt", "the text prompt", CONTEXT_LENGTH_MARK)):
        return prompt_param
    if details.startswith(("stop string", "stop strings")) or " stop strings, over " in details:
        return "stop"
    if "stop_token_ids" in details:
        return "stop_token_ids"
    first = details.split(" ", 1)[0]
    return first if first in SAMPLING_FIELDS else None


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)
