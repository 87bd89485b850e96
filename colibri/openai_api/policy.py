"""Who may call the front: the API key, the Host names it answers (against DNS rebinding) and the web origins
whose pages may call it (CORS). Values are checked here when the options are built; `guard.py` applies them to
every request. Stdlib only, so `colibri openai --help` stays fast."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from colibri_common.options import HOST_NAME

API_KEY_ENV = "COLIBRI_API_KEY"
ANY = "*"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD_ADDRESSES = ("", "0.0.0.0", "::")
DEFAULT_PORTS = {"http": "80", "https": "443"}
_KEY = re.compile(r"[\x21-\x7e]+")                      # visible ASCII: what an HTTP header carries as is
_ORIGIN = re.compile(r"(https?)://(\[[0-9a-f:.]+\]|[a-z0-9_.-]+)(?::(\d{1,5}))?")


class GuardOptions(Protocol):
    host: str
    api_key: str | None
    allowed_hosts: tuple[str, ...]
    allowed_origins: tuple[str, ...]


def check_key(key: str, source: str) -> str:
    """The key as given, or a ValueError that names where it came from (never the key itself)."""
    if not _KEY.fullmatch(key):
        raise ValueError(f"{source} must be printable ASCII without spaces (the value is not shown)")
    return key


def host_name(value: str) -> str | None:
    """The name a Host header value names, port stripped and normalised ('Example.COM.:80' -> 'example.com',
    '[0::1]:8000' -> '::1'), or None when it is not a host."""
    v = value.strip().lower()
    if v.startswith("["):
        inside, closed, rest = v[1:].partition("]")
        if not closed or (rest and not (rest[0] == ":" and rest[1:].isdigit())):
            return None
        try:
            return ipaddress.IPv6Address(inside).compressed
        except ValueError:
            return None
    name, _, port = v.partition(":")
    name = name.rstrip(".")
    if (port and not port.isdigit()) or not HOST_NAME.fullmatch(name):
        return None
    return name


def host_entry(entry: str) -> str:
    """One --allowed-hosts entry, normalised as `host_name` normalises headers: '*', '*.example.com', a name,
    an IP address (IPv6 with or without brackets); a port is ignored."""
    e = entry.strip().lower()
    if e == ANY:
        return ANY
    if e.startswith("*."):
        suffix = host_name(e[2:])
        if suffix is None or ":" in suffix:
            raise ValueError(f"--allowed-hosts: '{entry}' is not '*.' and a domain name")
        return "*." + suffix
    if e.count(":") > 1 and not e.startswith("["):
        e = f"[{e}]"                                    # a bare IPv6 address
    name = host_name(e)
    if name is None:
        raise ValueError(f"--allowed-hosts: '{entry}' is not a host name or address (give names such as "
                         f"api.example.com, 10.0.0.5, [::1], *.example.com, or '*' for any)")
    return name


def origin_of(value: str) -> str | None:
    """A web origin, normalised (lower case, no default port, no trailing slash), or None ('null', junk)."""
    m = _ORIGIN.fullmatch(value.strip().lower().removesuffix("/"))
    if m is None:
        return None
    scheme, host, port = m.groups()
    return f"{scheme}://{host}" + (f":{port}" if port and port != DEFAULT_PORTS[scheme] else "")


def origin_entry(entry: str) -> str:
    if entry.strip() == ANY:
        return ANY
    origin = origin_of(entry)
    if origin is None:
        raise ValueError(f"--allowed-origins: '{entry}' is not a web origin: give scheme://host[:port] with "
                         f"http or https and no path (e.g. https://app.example.com), or '*' for any")
    return origin


def api_key(opts: GuardOptions, env: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """(the key, where it came from): --api-key, else $COLIBRI_API_KEY (surrounding whitespace dropped, as a
    mounted Secret file may end in a newline); ("", "") when neither is set."""
    if opts.api_key is not None:
        return opts.api_key, "--api-key"
    key = env.get(API_KEY_ENV, "").strip()
    if not key and API_KEY_ENV in env:        # set, but to nothing (an empty Secret): a key was meant
        raise ValueError(f"${API_KEY_ENV} is set but empty (an empty Secret?): give the key, or unset the variable "
                         f"for a front without one")
    return (check_key(key, f"${API_KEY_ENV}"), f"${API_KEY_ENV}") if key else ("", "")


def local_names() -> set[str]:
    """This machine's addresses and host name: what a client may put in Host to reach a wildcard bind."""
    import psutil

    names = {socket.gethostname().lower()}
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                with_scope = a.address.split("%")[0]
                names.add(ipaddress.ip_address(with_scope).compressed)
    return names


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class Policy:
    key_digest: bytes | None            # SHA-256 of the API key (equal-length digests: nothing leaks its length)
    hosts: frozenset[str]               # names as `host_name` gives them; ANY = every Host
    host_suffixes: tuple[str, ...]      # ".example.com" for an entry '*.example.com'
    origins: frozenset[str]             # as `origin_of` gives them; ANY = every origin; empty = no browser page

    @classmethod
    def of(cls, opts: GuardOptions, bound: str, key: str = "") -> Policy:
        """The policy of a front bound to the address `bound` (what the socket reports)."""
        entries = [host_entry(e) for e in opts.allowed_hosts]
        if not entries:
            entries = [*LOOPBACK_NAMES, *(host_entry(h) for h in {opts.host, bound} if h not in WILDCARD_ADDRESSES)]
            if opts.host in WILDCARD_ADDRESSES or bound in WILDCARD_ADDRESSES:
                entries += sorted(local_names())
        return cls(key_digest=_digest(key.encode()) if key else None,
                   hosts=frozenset(e for e in entries if not e.startswith("*.")),
                   host_suffixes=tuple(e[1:] for e in entries if e.startswith("*.")),
                   origins=frozenset(origin_entry(e) for e in opts.allowed_origins))

    def host_ok(self, value: str) -> bool:
        if ANY in self.hosts:
            return True
        name = host_name(value)
        return name is not None and (name in self.hosts or name.endswith(self.host_suffixes))

    def origin_ok(self, value: str) -> bool:
        return ANY in self.origins or origin_of(value) in self.origins

    def key_ok(self, given: bytes) -> bool:
        """`given` is the API key, compared in constant time."""
        return self.key_digest is None or hmac.compare_digest(_digest(given), self.key_digest)
