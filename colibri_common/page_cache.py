"""The page cache under a mapped checkpoint, and the size of its pages.

Experts computed in place stream the checkpoint's bytes straight from the page cache. On Linux, where the
filesystem keeps a file's page cache in large folios (ext4 and xfs on recent kernels), those bytes can sit in
2 MiB pages, each mapped by one page-table entry (`FilePmdMapped` in /proc/PID/smaps): one TLB entry then
covers 512 times the bytes of a layer's expert streams. Measured on a 2-core AVX2
EPYC (Linux 6.18, ext4), the bench model in process at 8 streams, three alternating runs: 88.8 / 90.1 / 93.9
tok/s on 2 MiB pages against 80.9 / 85.4 / 79.2 on 4 KiB pages (`madvise(MADV_NOHUGEPAGE)` on the mapping).

Two things decide the page size, and this module handles both:

- how a fault fills the cache: `advise_huge` asks for 2 MiB pages on a mapping (MADV_HUGEPAGE), so a fault on
  bytes not yet cached reads a whole 2 MiB folio where the kernel can;
- how the file got into the cache: a file just written sits there in 4 KiB pages, and stays so until evicted
  (merging them in place, `MADV_COLLAPSE` on a file, needs CONFIG_READ_ONLY_THP_FOR_FS: EINVAL on the 6.18
  measured). `drop` writes a file's dirty pages out and evicts its cached ones (fdatasync, POSIX_FADV_DONTNEED),
  so the next reader fills the cache from the disk, in large folios. Whoever writes a checkpoint calls it after
  writing.

`huge_share` / `mapped_pages` say how much of a file's resident mapping is on 2 MiB pages, from /proc/self/smaps
(an expert worker exports it as `colibri:checkpoint_resident_bytes{page}`).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading
from collections.abc import Iterable
from pathlib import Path


def advise_huge(m: mmap.mmap) -> bool:
    """Ask for 2 MiB pages on a file mapping (MADV_HUGEPAGE); False where the platform or kernel refuses."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:                      # a kernel without transparent huge pages: 4 KiB pages, as before
        return False
    return True


MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)      # Linux 5.14 (Python 3.11's mmap has no name for it)
_PAGE = mmap.PAGESIZE
_CHUNK = 64 * 2**20      # a call's bytes: `stop` is looked at between them (from a cold page cache, a read from disk)


def populate(ranges: Iterable[tuple[int, int]], stop: threading.Event | None = None) -> int | None:
    """Fill the page-table entries of file mappings for the (address, length) ranges now (MADV_POPULATE_READ),
    so that their first reads take no fault: the first requests after a start had faulted in the experts they met,
    each fault mapping 64 KiB (fault-around), and took up to 3x their time (the bench model's 16-token prefill:
    72-99 ms for the first requests, 32-35 once every expert had been met). Bytes not in the page cache are read
    from the disk. The ranges are merged and rounded out to whole pages; `stop` set ends it between ranges. The
    bytes populated, or None where the kernel refuses (before 5.14, not Linux)."""
    spans: list[list[int]] = []
    for start, stop_at in sorted((a - a % _PAGE, a + n) for a, n in ranges if n > 0):
        end = -(-stop_at // _PAGE) * _PAGE
        if spans and start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    libc = _libc()
    if libc is None:
        return None
    done = 0
    for start, end in ((a, min(hi, a + _CHUNK)) for lo, hi in spans for a in range(lo, hi, _CHUNK)):
        if stop is not None and stop.is_set():
            break
        if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_POPULATE_READ) != 0:
            if ctypes.get_errno() == errno.EINVAL:      # a kernel without it: nothing to do, as before
                return None
            continue                                     # unmapped meanwhile (a shard released): the rest goes on
        done += end - start
    return done


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def drop(path: str | Path) -> bool:
    """Write a file's dirty pages out and evict its cached pages (pages mapped elsewhere stay), so the next
    reader fills the page cache from the disk: in 2 MiB folios where the filesystem makes them. Best effort:
    False where the platform has no POSIX_FADV_DONTNEED (macOS) or the filesystem refuses (some FUSE mounts)."""
    if not hasattr(os, "posix_fadvise") or not hasattr(os, "fdatasync"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)                       # dirty pages cannot be evicted
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    except OSError:
        return False
    return True


def drop_checkpoint(model_dir: str | Path) -> None:
    """`drop` for every safetensors file of a checkpoint directory just written."""
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        drop(path)


_HEX = frozenset("0123456789abcdef")        # smaps' field lines start with a capital letter


def huge_share(path: str | Path, smaps: str = "/proc/self/smaps") -> tuple[int, int] | None:
    """(resident bytes, bytes on 2 MiB pages) of this process's mappings of `path`; None where there is no
    /proc (not Linux) or no mapping of it."""
    return mapped_pages([path], smaps)


def mapped_pages(paths: Iterable[str | Path], smaps: str = "/proc/self/smaps") -> tuple[int, int] | None:
    """(resident bytes, bytes on 2 MiB pages) of this process's mappings of any of `paths` (smaps read once);
    None where there is no /proc (not Linux) or no mapping of them. "2 MiB" is the PMD size of x86-64 (smaps'
    FilePmdMapped; other page-table geometries have other sizes)."""
    targets = {str(Path(p).resolve()) for p in paths}
    try:
        lines = Path(smaps).read_text().splitlines()
    except OSError:
        return None
    rss = pmd = 0
    found = mine = False
    for line in lines:
        if line[:1] in _HEX:                                             # a mapping's first line: "lo-hi perms ..."
            head = line.split(maxsplit=5)
            mine = len(head) == 6 and head[5].strip() in targets
            found = found or mine
        elif mine and line.startswith("Rss:"):
            rss += int(line.split()[1]) * 1024
        elif mine and line.startswith("FilePmdMapped:"):
            pmd += int(line.split()[1]) * 1024
    return (rss, pmd) if found else None
