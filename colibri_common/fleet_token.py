"""The worker plane's shared credential: a token every call from a router to a worker carries in its metadata.

`colibri serve` makes one per fleet (`new_token`) and hands it to its children in the environment
(`COLIBRI_FLEET_TOKEN`, never in argv, which `ps` shows); a router or worker started alone reads the same variable
(a Kubernetes Secret, say). A worker with a token refuses every call without it, UNAUTHENTICATED, before it reads a
byte of the request, and a router adds it to every call (colibri_common/token_gate.py: gRPC lives there, so the
CLI starts without it). Mutual TLS (`--tls-*`) is the other way to close the plane, and the chart's.
"""

from __future__ import annotations

import os
import secrets

from colibri_common.errors import ConfigError

ENV = "COLIBRI_FLEET_TOKEN"


def fleet_token() -> str | None:
    """The token of this process's fleet, from the environment; None when there is none."""
    token = os.environ.get(ENV, "")
    if not token:
        return None
    if len(token) < 16 or not token.isascii() or not token.isprintable() or " " in token:
        raise ConfigError(f"${ENV} must be at least 16 printable ASCII characters without spaces (a shared secret "
                          f"of the fleet, e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)")
    return token


def new_token() -> str:
    return secrets.token_urlsafe(32)
