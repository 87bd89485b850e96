"""Files a process has mapped, watched for changes under it: a checkpoint truncated, overwritten or replaced
while mapped would fault the next read of the lost pages (SIGBUS, the whole process gone) or feed it other
bytes. `FileWatch` keeps each file's identity (device, inode, size, mtime) from when it was mapped; `changed`
says which one differs and how, `watch` checks them on a thread of its own and calls back once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("colibri")

EXIT_RESTART = 75          # EX_TEMPFAIL: a service stopped because bytes it maps changed; a restart maps them afresh


@dataclass(frozen=True)
class Stamp:
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @staticmethod
    def of(path: Path) -> Stamp:
        st = os.stat(path)
        return Stamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class FileWatch:
    def __init__(self, paths: Iterable[Path | str], stamps: dict[Path, Stamp] | None = None) -> None:
        """`stamps`: each file's identity when it was mapped, where known (a change between the mapping and
        this watch is then seen too); the others are taken now."""
        known = stamps or {}
        self.stamps = {Path(p): known.get(Path(p)) or Stamp.of(Path(p)) for p in dict.fromkeys(paths)}
        self.reason: str | None = None        # the first change seen, kept
        self._stop = threading.Event()
        # descriptors of the mapped inodes: fstat on them costs a fraction of a microsecond, so a reader can
        # check the files it is about to read each time (a truncation is what faults a mapping)
        self._fds = {p: os.open(p, os.O_RDONLY) for p in self.stamps}
        # every file's (path, descriptor, identity), for `stale()` of them all: a decode step checks before it reads,
        # on caches the weights' stream has just flushed, where each Path hashed or compared was a miss
        self._every = [(p, self._fds[p], was) for p, was in self.stamps.items()]

    def stale(self, paths: Iterable[Path] | None = None) -> str | None:
        """Before a read through the mapping of `paths` (default: every watched file): why not (a file truncated
        or written to), or None."""
        if self.reason is not None:
            return self.reason
        for path, fd, was in self._every if paths is None else ((p, self._fds.get(p), self.stamps.get(p))
                                                                  for p in paths):
            if fd is None or was is None:     # closed: its owner is stopping and reads nothing more
                return None
            st = os.fstat(fd)
            if st.st_size != was.size:
                self.reason = f"{path} changed size while mapped ({was.size} -> {st.st_size} bytes)"
            elif st.st_mtime_ns != was.mtime_ns:
                self.reason = f"{path} was written to while mapped (its modification time changed)"
            if self.reason is not None:
                return self.reason
        return None

    def identities(self, paths: Iterable[Path]) -> tuple[tuple[int, int, int], ...] | None:
        """(descriptor, size, mtime_ns as mapped) of each of `paths`, for a native reader that checks them as `stale`
        does (kernels/native_door.py); None once closed, or for a path not watched."""
        out = []
        for path in paths:
            fd, was = self._fds.get(path), self.stamps.get(path)
            if fd is None or was is None:
                return None
            out.append((fd, was.size, was.mtime_ns))
        return tuple(out)

    def changed(self) -> str | None:
        """What changed under the mapping (a sentence naming the file), or None; the first answer stays."""
        if self.reason is not None:
            return self.reason
        for path, was in self.stamps.items():
            try:
                now = Stamp.of(path)
            except OSError as exc:
                self.reason = f"{path} was removed or became unreadable while mapped ({exc.strerror})"
                break
            if (now.dev, now.ino) != (was.dev, was.ino):
                self.reason = f"{path} was replaced by another file while mapped"
            elif now.size != was.size:
                self.reason = f"{path} changed size while mapped ({was.size} -> {now.size} bytes)"
            elif now.mtime_ns != was.mtime_ns:
                self.reason = f"{path} was written to while mapped (its modification time changed)"
            if self.reason is not None:
                break
        return self.reason

    def watch(self, on_change: Callable[[str], None], interval_s: float = 0.25) -> None:
        """Check every `interval_s` on a daemon thread; call `on_change(reason)` once, at the first change."""
        def loop() -> None:
            while not self._stop.wait(interval_s):
                reason = self.changed()
                if reason is not None:
                    on_change(reason)
                    return

        threading.Thread(target=loop, name="file-watch", daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._every.clear()


class MappingChanged(Exception):
    """A mapped file changed: nothing may read through its mapping any more (the message names it)."""


def files_settled(directory: Path | str, stop: threading.Event, quiet_s: float = 1.0, limit_s: float = 600.0,
                  say: Callable[[str], None] = log.info) -> bool:
    """Wait until the checkpoint files of `directory` (*.safetensors and *.json) have kept their sizes and
    modification times for `quiet_s` seconds, at most `limit_s`: a service that stopped because its files changed
    starts again on a copy that is complete, not on one still being written (its start would fail, and a fleet
    stop with it). False when `stop` was set or the limit passed."""

    def stamps() -> dict[str, tuple[int, int]]:
        out = {}
        for p in sorted(Path(directory).glob("*")):
            if p.suffix in (".safetensors", ".json"):
                try:
                    st = p.stat()
                except OSError:
                    continue
                out[p.name] = (st.st_size, st.st_mtime_ns)
        return out

    deadline, told = time.monotonic() + limit_s, False
    before = stamps()
    while time.monotonic() < deadline:
        if stop.wait(quiet_s):
            return False
        now = stamps()
        if now == before:
            return True
        if not told:
            say(f"the checkpoint files in {directory} are changing; waiting until they stay the same for "
                f"{quiet_s:g} s (at most {limit_s:g} s)")
            told = True
        before = now
    return False
