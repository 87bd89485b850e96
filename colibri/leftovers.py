"""What a `colibri serve` killed with SIGKILL leaves behind, removed by the next one: its workers' socket directory
(`colibri-fleet-SCOPE-PID-*` in the temp dir, mode 0700) and its throw-away TLS files (`tls-SCOPE-PID` in
$COLIBRI_CACHE_DIR or the temp dir). A fleet stopped any other way removes its own; SIGKILL gives it no chance,
so each crash left one directory behind.

SCOPE names this host and PID namespace (a hash of the host name and /proc/self/ns/pid): a directory is judged
only by a serve that sees the same process table, so a temp or cache directory shared between containers or hosts
(a bind mount, NFS) never loses a live fleet's files to another one's sweep. Only this user's directories are
touched, only those whose serve process is gone and whose sockets nobody answers on, and only when they hold
nothing but what serve puts there.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("colibri.serve")
_TLS_FILES = frozenset({"ca.pem", "cert.pem", "key.pem"})      # colibri_common.tls.SELF_SIGNED_FILES


@functools.cache
def scope() -> str:
    """8 hex digits naming this host and PID namespace (where a pid means the same process)."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{ns}".encode()).hexdigest()[:8]


def fleet_prefix() -> str:
    """The socket directory's prefix for this serve process (mkdtemp adds a random part)."""
    return f"colibri-fleet-{scope()}-{os.getpid()}-"


def tls_name() -> str:
    """The throw-away TLS directory's name for this serve process."""
    return f"tls-{scope()}-{os.getpid()}"


def _gone(pid: int) -> bool:
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:                   # alive, another user's
        return False
    return False


def _listening(path: Path) -> bool:
    """A socket some worker still answers on."""
    if not path.is_socket():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _left(entry: Path, names: re.Pattern[str], allowed: Callable[[str], bool]) -> bool:
    """Whether `entry` is a directory of this user and scope that `names` matches, whose serve is gone, holding
    only `allowed` files of which none is a socket in use."""
    found = names.fullmatch(entry.name)
    if found is None or not _gone(int(found.group(1))):
        return False
    try:
        if entry.is_symlink() or not entry.is_dir() or entry.lstat().st_uid != os.getuid():
            return False
        files = list(entry.iterdir())
    except OSError:
        return False
    return all(allowed(f.name) for f in files) and not any(_listening(f) for f in files)


def sweep(temp_dir: Path, tls_dir: Path) -> list[Path]:
    """Remove the leftovers of serve processes of this scope that are gone; the directories removed."""
    kinds = ((temp_dir, re.compile(rf"colibri-fleet-{scope()}-(\d+)-\w+"),
              lambda n: n.startswith("worker-") and n.endswith(".sock")),
             (tls_dir, re.compile(rf"tls-{scope()}-(\d+)"), lambda n: n in _TLS_FILES))
    removed = []
    for directory, names, allowed in kinds:
        try:
            entries = list(directory.iterdir())
        except OSError:
            continue
        for entry in entries:
            if _left(entry, names, allowed):
                shutil.rmtree(entry, ignore_errors=True)
                if not entry.exists():
                    removed.append(entry)
    if removed:
        log.info("removed what %d fleet(s) killed before they could stop left behind: %s", len(removed),
                 ", ".join(str(p) for p in removed))
    return removed
