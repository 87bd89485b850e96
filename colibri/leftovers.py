"""What a `colibri serve` killed with SIGKILL leaves behind, removed by the next one: its workers' socket directory
(`colibri-fleet-PID-*` in the temp dir, mode 0700) and its throw-away TLS files (`tls-PID` in $COLIBRI_CACHE_DIR or
the temp dir). A fleet stopped any other way removes its own; SIGKILL gives it no chance, so each crash left one
directory behind. Only this user's directories are touched, only those whose serve process is gone and whose
sockets nobody answers on, and only when they hold nothing but what serve puts there.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
from pathlib import Path

log = logging.getLogger("colibri.serve")
FLEET_PREFIX = "colibri-fleet-"               # + the serve process's pid + "-" + mkdtemp's random part
_FLEET = re.compile(rf"{FLEET_PREFIX}(\d+)-\w+")
_TLS = re.compile(r"tls-(\d+)")
_TLS_FILES = frozenset({"ca.pem", "cert.pem", "key.pem"})      # colibri_common.tls.SELF_SIGNED_FILES


def fleet_prefix() -> str:
    """The socket directory's prefix for this serve process (its pid names it, so a later serve can tell it is
    gone)."""
    return f"{FLEET_PREFIX}{os.getpid()}-"


def tls_name() -> str:
    """The throw-away TLS directory's name for this serve process."""
    return f"tls-{os.getpid()}"


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


def _ours(entry: Path, names: re.Pattern[str], allowed: object) -> int | None:
    """The pid in `entry`'s name when it is a directory of this user that `names` matches and whose files are
    all `allowed(name)`; else None."""
    found = names.fullmatch(entry.name)
    if found is None:
        return None
    try:
        st = entry.lstat()
        if not entry.is_dir() or entry.is_symlink() or st.st_uid != os.getuid():
            return None
        files = list(entry.iterdir())
        if not all(allowed(f.name) for f in files) or any(_listening(f) for f in files):   # type: ignore[operator]
            return None
    except OSError:
        return None
    return int(found.group(1))


def _listening(path: Path) -> bool:
    """A socket some worker still answers on (a serve whose pid this process cannot see: another PID namespace
    sharing the temp dir)."""
    if not path.is_socket():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def sweep(temp_dir: Path, tls_dir: Path) -> list[Path]:
    """Remove the leftovers of serve processes that are gone; the directories removed."""
    candidates = []
    for directory, names, allowed in ((temp_dir, _FLEET, lambda n: n.startswith("worker-") and n.endswith(".sock")),
                                      (tls_dir, _TLS, lambda n: n in _TLS_FILES)):
        try:
            entries = list(directory.iterdir())
        except OSError:
            continue
        candidates += [e for e in entries if (pid := _ours(e, names, allowed)) is not None and _gone(pid)]
    removed = []
    for entry in candidates:
        shutil.rmtree(entry, ignore_errors=True)
        if not entry.exists():
            removed.append(entry)
    if removed:
        log.info("removed what %d fleet(s) killed before they could stop left behind: %s", len(removed),
                 ", ".join(str(p) for p in removed))
    return removed
