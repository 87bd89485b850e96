"""The front's door, an ASGI middleware before every route: the Host header (421, against DNS rebinding), CORS
(headers and preflights only for the origins of --allowed-origins; other preflights 403), the API key (401;
/health stays open to probes) and JSON bodies only (415: a web page cannot send JSON to another site without a
preflight), uncompressed (415 for a Content-Encoding: the front would read compressed bytes as the JSON). A
refusal is an OpenAI-shaped error, counted in the metrics; the request never reaches a route."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from starlette.responses import JSONResponse, Response

from colibri.openai_api.errors import ApiError
from colibri.openai_api.policy import Policy

OPEN_PATHS = frozenset({"/health"})                 # readiness probes carry no key
CORS_METHODS = b"GET, POST, OPTIONS"
CORS_HEADERS = b"authorization, content-type"
CORS_MAX_AGE = b"600"
_HEADER_LIST = re.compile(rb"[A-Za-z0-9!#$%&'*+.^_`|~, -]*")      # header names and commas, safe to echo back
Scope = dict[str, Any]


def _headers(scope: Scope) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = {}
    for name, value in scope["headers"]:
        out.setdefault(name.lower(), []).append(value)
    return out


def _text(value: bytes) -> str:
    return value.decode("latin-1")


def _shown(value: bytes, limit: int = 80) -> str:
    """A header value fit to quote back in a message: printable, and short."""
    text = "".join(c if c.isprintable() else "?" for c in _text(value))
    return text if len(text) <= limit else text[:limit] + "..."


def refusal(scope: Scope, headers: dict[bytes, list[bytes]], policy: Policy) -> ApiError | None:
    """Why this request may not go on, or None. The order: the checks that hold for every route first."""
    hosts = headers.get(b"host", [])
    if len(hosts) > 1:
        return ApiError(400, f"the request has {len(hosts)} Host headers; send one")
    if not hosts and scope.get("http_version") == "1.1":    # RFC 9112: a server answers 400 (as nginx does)
        return ApiError(400, "an HTTP/1.1 request needs a Host header; send one")
    if hosts and not policy.host_ok(_text(hosts[0])):      # no Host at all (HTTP/1.0): no browser, nothing to rebind
        return ApiError(421, f"this front does not answer to the host name '{_shown(hosts[0])}' (the Host header); "
                             f"if that is its name, start it with --allowed-hosts naming it (or '*' for any)",
                        code="host_not_allowed")
    if _preflight(scope, headers):                      # a browser asks whether a page of that origin may call
        origin = headers[b"origin"][0]
        if not policy.origin_ok(_text(origin)):
            return ApiError(403, f"web pages of '{_shown(origin)}' (the Origin header) may not call this front; "
                                 f"to let them, start it with --allowed-origins naming that origin",
                            code="origin_not_allowed")
        return None
    if policy.key_digest is not None and scope["path"] not in OPEN_PATHS:
        auth = headers.get(b"authorization", [b""])[0]
        scheme, _, given = auth.strip().partition(b" ")
        if not auth:
            return ApiError(401, "this front needs an API key: send the header 'Authorization: Bearer KEY' (KEY is "
                                 "the front's --api-key or $COLIBRI_API_KEY)", code="missing_api_key")
        if scheme.lower() != b"bearer" or not policy.key_ok(given.strip()):
            return ApiError(401, "the API key is not valid: send 'Authorization: Bearer KEY' with the front's key",
                            code="invalid_api_key")
    if scope["method"] == "POST":
        if len(kinds := headers.get(b"content-type", [])) > 1:   # the first alone was checked: a second passed
            return ApiError(400, f"the request has {len(kinds)} Content-Type headers; send one")
        kind = headers.get(b"content-type", [b""])[0]
        media, *params = (p.strip().lower() for p in _text(kind).split(";"))
        charset = next((p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")), "utf-8")
        if media != "application/json" or charset not in ("utf-8", "utf8"):
            got = f"'{_shown(kind)}'" if kind else "none"
            return ApiError(415, f"the request body must be JSON sent with 'Content-Type: application/json' (UTF-8); "
                                 f"this request's Content-Type is {got}", code="unsupported_media_type")
        codings = headers.get(b"content-encoding", [])
        if any(c.strip().lower() not in ("", "identity") for v in codings for c in _text(v).split(",")):
            return ApiError(415, f"this front reads request bodies as sent, not compressed: send the body without "
                                 f"Content-Encoding (this request's is '{_shown(b', '.join(codings))}')",
                            code="unsupported_content_encoding")
    return None


def _preflight(scope: Scope, headers: dict[bytes, list[bytes]]) -> bool:
    return scope["method"] == "OPTIONS" and b"origin" in headers and b"access-control-request-method" in headers


def cors_headers(headers: dict[bytes, list[bytes]], policy: Policy) -> list[tuple[bytes, bytes]]:
    """The CORS headers for a request from an allowed origin (none without --allowed-origins or an Origin)."""
    origin = headers.get(b"origin")
    if not policy.origins or origin is None or not policy.origin_ok(_text(origin[0])):
        return []
    return [(b"access-control-allow-origin", origin[0]), (b"vary", b"origin")]


def preflight_reply(headers: dict[bytes, list[bytes]], cors: list[tuple[bytes, bytes]]) -> Response:
    asked = b", ".join(headers.get(b"access-control-request-headers", []))
    allowed = asked if asked and _HEADER_LIST.fullmatch(asked) else CORS_HEADERS
    reply = Response(status_code=204)
    reply.raw_headers += [*cors, (b"access-control-allow-methods", CORS_METHODS),
                          (b"access-control-allow-headers", allowed), (b"access-control-max-age", CORS_MAX_AGE)]
    return reply


class Guard:
    """The middleware: `refused(status)` counts each refusal."""

    def __init__(self, app: Any, policy: Policy, refused: Callable[[int], None]) -> None:
        self.app, self.policy, self.refused = app, policy, refused

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = _headers(scope)
        err = refusal(scope, headers, self.policy)
        cors = cors_headers(headers, self.policy) if err is None or err.status in (401, 415) else []
        if err is not None:
            self.refused(err.status)
            extra = {"WWW-Authenticate": "Bearer"} if err.status == 401 else {}
            reply = JSONResponse(err.body(), status_code=err.status, headers=extra)
            reply.raw_headers += cors                   # a page that may call us reads why it was refused
            await reply(scope, receive, send)
        elif _preflight(scope, headers):
            await preflight_reply(headers, cors)(scope, receive, send)
        elif cors:
            async def send_with_cors(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []), *cors]}
                await send(message)

            await self.app(scope, receive, send_with_cors)
        else:
            await self.app(scope, receive, send)
