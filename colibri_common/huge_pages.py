"""Weights a process reads on every decode step, moved onto 2 MiB pages (anonymous memory advised MADV_HUGEPAGE).

A decode step streams each layer's weights once, on caches that the rest of the step has flushed, TLB included:
on 4 KiB pages every 4 KiB of weight is a page walk of its own, whose page-table entries are cold as well. Torch's
allocator hands out 4 KiB pages where transparent huge pages are `madvise` (the common default), so the router's
copied weights (the stacked qkv, o, gates, norms; the mapped embedding and lm_head are the page cache's, advised
by colibri_common/page_cache.py) sat on them. `onto_huge_pages` copies a set of tensors (the router: a layer's)
into one mapping aligned to 2 MiB and advised huge; a fault then fills a whole 2 MiB page where the kernel can.
Measured on the small model's attention block after a 64 MB stream (2 threads, the 2-core Xeon): 356 µs on 4 KiB
pages, 315 on 2 MiB (docs/performance.md).
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

HUGE = 2 << 20
ALIGN = 64                        # each tensor starts on a cache line, as torch's allocator aligns


THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_advisable() -> bool:
    """Whether advising MADV_HUGEPAGE can give huge pages here: Linux with transparent huge pages in `always` or
    `madvise` mode (under `never`, which an administrator sets to keep them off, the advice is taken and ignored)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_MODE.read_text()
    except OSError:
        return False


def onto_huge_pages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` (CPU, any dtype and shape) laid out one after another in one anonymous mapping aligned to
    2 MiB and advised MADV_HUGEPAGE; each copy keeps the mapping alive. The tensors themselves where the platform
    or kernel refuses the advice (no copy is worth making then), or where there are none."""
    if not tensors or not huge_pages_advisable():
        return tensors
    offsets, total = [], 0
    for t in tensors:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += t.numel() * t.element_size()
    m = mmap.mmap(-1, total + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # private: shared is shmem's
    anchor = ctypes.c_char.from_buffer(m)
    start = -ctypes.addressof(anchor) % HUGE                                     # the first 2 MiB boundary
    del anchor                                                                   # (a live export pins the map)
    try:
        m.madvise(mmap.MADV_HUGEPAGE, start, -(-total // mmap.PAGESIZE) * mmap.PAGESIZE or mmap.PAGESIZE)
    except OSError:                                                              # no transparent huge pages
        m.close()
        return tensors
    base = torch.frombuffer(m, dtype=torch.uint8, offset=start, count=total)     # keeps `m` alive
    out = []
    for t, off in zip(tensors, offsets, strict=True):
        n = t.numel() * t.element_size()
        copy = base[off:off + n].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
    return out
