"""`--follow-workers NAME:PORT`: the workers are whatever NAME resolves to (a Kubernetes headless Service: one
address per expert pod), polled every few seconds; a change of the set re-plans through the same switch as
`colibri workers set`, so `kubectl scale` or an HPA resizes the expert fleet.

An address is named by its reverse (PTR) record where that is a name under NAME's own domain (a StatefulSet
pod's stable `<pod>.<service>.<ns>.svc...`, which its TLS certificate carries), else by its IP. An address an
operator removed (`colibri workers remove`, a pod's preStop hook) is left out until it leaves the Service or
a new pod takes its name (another IP), so a draining pod is not taken back while it stops.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from colibri_common.errors import ConfigError

log = logging.getLogger("colibri.router")


def split_target(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"--follow-workers must be NAME:PORT (a headless Service and the workers' port), got "
                          f"'{target}'")
    return host, int(port)


def resolve(target: str) -> dict[str, str]:
    """The workers NAME:PORT stands for now, sorted, each with its IP; empty when it does not resolve (no pod
    yet)."""
    host, port = split_target(target)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return {}
    domain = host.partition(".")[0]
    out = {}
    for *_, addr in infos:
        ip = addr[0]
        name = ip if ":" not in ip else f"[{ip}]"
        try:
            ptr = socket.gethostbyaddr(ip)[0]
            if f".{domain}." in f".{ptr}.":                  # <pod>.<service>.<ns>.svc...: the stable name
                name = ptr
        except OSError:
            pass
        out[f"{name}:{port}"] = ip
    return dict(sorted(out.items()))


def wait_for_workers(target: str, timeout_s: float) -> tuple[str, ...]:
    """The workers `target` resolves to once it resolves to any (a fleet's first pods may still be starting)."""
    start = time.monotonic()
    deadline, said = start + timeout_s, -1e9
    while not (found := tuple(resolve(target))):
        now = time.monotonic()
        if now > deadline:
            raise ConfigError(f"--follow-workers {target} resolved to no address within {timeout_s:.0f}s "
                              f"({why_unresolved(target)})")
        if now - said >= 30.0:                  # at once, then every 30 s: not a silent wait of minutes
            log.warning("--follow-workers %s resolves to no address yet (%s) after %.0f s; waiting up to %.0f s more "
                        "(the fleet's worker pods may still be starting)", target, why_unresolved(target),
                        now - start, deadline - now)
            said = now
        time.sleep(1.0)
    log.info("%s resolves to %s", target, ", ".join(found))
    return found


def why_unresolved(target: str) -> str:
    """What the resolver says of a target that gave no address, for the log."""
    host, port = split_target(target)
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return f"{host}: {exc.strerror or exc}"
    return f"{host} has no address now"


class Follower:
    """Polls `target` every `interval_s`; calls `change(workers)` when the set (less `cordoned()`) differs from
    `current()`."""

    def __init__(self, target: str, current: Callable[[], tuple[str, ...]], change: Callable[[tuple[str, ...]], None],
                 cordoned: Callable[[], set[str]], uncordon: Callable[[set[str]], None], interval_s: float = 5.0
                 ) -> None:
        split_target(target)
        self.target, self.current, self.change = target, current, change
        self.cordoned, self.uncordon, self.interval_s = cordoned, uncordon, interval_s
        self._cordon_ip: dict[str, str] = {}              # a cordoned name's IP when first seen cordoned
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="follow-workers", daemon=True).start()

    def poll(self) -> None:
        seen = resolve(self.target)
        if not seen:
            return                                           # a DNS hiccup or every pod gone: keep what serves
        cordoned = self.cordoned()
        for name in cordoned & set(seen):
            self._cordon_ip.setdefault(name, seen[name])
        # it left the Service, or a new pod took its name (a StatefulSet's restart: a new IP): it may serve again
        back = {a for a in cordoned if a not in seen or self._cordon_ip.get(a, seen[a]) != seen[a]}
        if back:
            self.uncordon(back)
            for a in back:
                self._cordon_ip.pop(a, None)
        want = tuple(a for a in seen if a not in self.cordoned())
        if want and set(want) != set(self.current()):
            log.info("%s now resolves to %s: re-planning", self.target, ", ".join(want))
            self.change(want)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 (logged; the next poll tries again)
                log.exception("following %s failed", self.target)

    def close(self) -> None:
        self._stop.set()
