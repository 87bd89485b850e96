"""Give the C heap's free pages back to the OS after a load that made many short-lived buffers.

Quantising or converting weights at start-up allocates and frees a float copy per tensor; glibc keeps
those freed pages in its arenas, so the worker's RSS stays tens of MiB above what it really holds, and an
SRE reading `kubectl top` sees memory that is not in use. `malloc_trim(0)` returns them.

`skip_exit_collection` is for the other end of a process's life.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)


def return_free_heap() -> bool:
    """True when the C library trimmed its heap (glibc); False where there is no malloc_trim (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    released = bool(trim(0))
    log.debug("malloc_trim: %s", "returned free pages" if released else "nothing to return")
    return True


def skip_exit_collection() -> None:
    """Call just before a process exits: Python's last garbage collection walks every object torch and
    transformers made (1-2.5 s of an exit on the dev VM) to free memory the OS takes back anyway; frozen,
    they are left alone. Exit handlers still run."""
    gc.disable()
    gc.freeze()
