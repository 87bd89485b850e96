"""The page cache under a mapped checkpoint (colibri_common/page_cache.py): the checkpoint's mappings ask for
2 MiB pages, a written file is evicted by `drop` (so its next reader fills the cache from the disk, in large
folios where the filesystem makes them), and `huge_share` reads a mapping's resident and 2 MiB-page bytes from
/proc/self/smaps. Real files, real mappings, the kernel's own accounts (mincore, smaps)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from colibri_common import page_cache
from colibri_common.checkpoint import Checkpoint
from colibri_common.huge_pages import huge_pages_advisable

linux = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE")
                           or not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
                           reason="Linux's /proc and transparent huge pages (madvise(MADV_HUGEPAGE))")
EVICTABLE = ("ext4", "xfs", "btrfs")          # filesystems whose clean pages POSIX_FADV_DONTNEED evicts


def vm_flags(path: Path) -> list[str]:
    """The VmFlags of this process's mappings of `path`, from /proc/self/smaps."""
    target, mine, out = str(path.resolve()), False, []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:
            mine = len(head) == 6 and head[5].strip() == target
        elif mine and line.startswith("VmFlags:"):
            out += line.split()[1:]
    return out


def resident_pages(m: mmap.mmap) -> int:
    """How many of a mapping's pages are in the page cache (mincore)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    n = -(-len(m) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * n)()
    anchor = ctypes.c_char.from_buffer(m)
    try:
        if libc.mincore(ctypes.addressof(anchor), len(m), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
    finally:
        del anchor
    return sum(v & 1 for v in vec)


def filesystem(path: Path) -> str:
    """The type of the filesystem holding `path` (the longest mount point above it)."""
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, fstype = line.split()[:3]
        point = point.replace("\\040", " ")                                # /proc/self/mounts escapes spaces
        if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) >= len(best):   # the last wins
            best, kind = point, fstype
    return kind


@linux
def test_checkpoint_mappings_ask_for_huge_pages(tmp_path):
    want = torch.randn(64, 64)
    save_file({"w": want}, str(tmp_path / "model.safetensors"))
    ck = Checkpoint(tmp_path)
    assert torch.equal(ck.view("w"), want)                                 # mapped and read
    assert "hg" in vm_flags(tmp_path / "model.safetensors"), "the mapping lacks MADV_HUGEPAGE"


@linux
def test_drop_evicts_a_file_just_written(tmp_path):
    if filesystem(tmp_path) not in EVICTABLE:
        pytest.skip(f"{filesystem(tmp_path)}: not a filesystem known to evict on POSIX_FADV_DONTNEED")
    path = tmp_path / "model.safetensors"
    want = torch.randn(1024, 1024)                                         # 4 MiB
    save_file({"w": want}, str(path))
    with path.open("rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        assert resident_pages(m) > 0, "a file just written is in the page cache"
    finally:
        m.close()
    assert page_cache.drop(path)
    with path.open("rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        assert resident_pages(m) == 0, "drop left the file's pages in the cache"
    finally:
        m.close()
    assert torch.equal(Checkpoint(tmp_path).view("w"), want)               # read back from the disk, intact


@linux
def test_huge_share_counts_the_mapping_of_that_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(512, 512)}, str(path))                    # 1 MiB
    assert page_cache.huge_share(path) is None                             # not mapped yet
    ck = Checkpoint(tmp_path)
    ck.view("w").sum()                                                     # every page touched
    rss, pmd = page_cache.huge_share(path)
    assert rss >= path.stat().st_size - mmap.PAGESIZE and 0 <= pmd <= rss
    smaps = tmp_path / "smaps"                                             # the parser on a known text
    smaps.write_text(
        f"7f0000000000-7f0000400000 r--p 00000000 fd:00 12 {path.resolve()}\nRss:                4096 kB\n"
        "FilePmdMapped:      2048 kB\nVmFlags: rd mr mw me hg\n"
        "7f0000400000-7f0000600000 r--p 00000000 fd:00 13 /elsewhere/other.safetensors\nRss: 2048 kB\n"
        "FilePmdMapped: 2048 kB\n"
        f"7f0000600000-7f0000800000 r--p 00400000 fd:00 12 {path.resolve()}\nRss:                1024 kB\n"
        "FilePmdMapped:         0 kB\n"
        "7f0000800000-7f0000a00000 rw-p 00000000 00:00 0 \nRss:                2048 kB\n"     # anonymous, after
        "FilePmdMapped:         0 kB\nAnonHugePages:   2048 kB\n"
        f"7f0000a00000-7f0000c00000 r--p 00000000 fd:00 14 {tmp_path.resolve()}/a b.safetensors\n"
        "Rss:                 512 kB\nFilePmdMapped:         0 kB\n")
    assert page_cache.huge_share(path, smaps=str(smaps)) == (5 * 2**20, 2 * 2**20)
    assert page_cache.huge_share(tmp_path / "a b.safetensors", smaps=str(smaps)) == (512 * 1024, 0)
    assert page_cache.huge_share(tmp_path / "absent", smaps=str(smaps)) is None
    assert page_cache.huge_share(path, smaps=str(tmp_path / "no-such-file")) is None


@linux
def test_the_bench_header_reports_the_page_state(tmp_path):
    from benchmarks.common import page_state
    save_file({"w": torch.randn(1024, 1024)}, str(tmp_path / "model.safetensors"))         # 4 MiB
    line = page_state(tmp_path)
    assert re.fullmatch(r"checkpoint page cache: \d+% of 0\.00 GiB on 2 MiB pages", line), line
    assert page_cache.huge_share(tmp_path / "model.safetensors") is None                   # unmapped after


@pytest.mark.skipif(not huge_pages_advisable(), reason="transparent huge pages are off here (or not Linux)")
def test_the_kernels_bench_copies_weights_onto_2mib_aligned_memory():
    from benchmarks.native_kernels import huge_copy
    from kernels import quantize_int8
    t = torch.randn(1024, 1024).bfloat16()                                               # 2 MiB
    c = huge_copy(t)
    assert torch.equal(c, t) and c.data_ptr() % (2 * 2**20) == 0 and c.data_ptr() != t.data_ptr()
    w = quantize_int8(torch.randn(64, 96))
    h = huge_copy(w)
    assert torch.equal(h.q, w.q) and h.q.data_ptr() % (2 * 2**20) == 0 and h.scale is w.scale


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise and /proc/self/smaps")
def test_populate_maps_the_ranges_pages_before_any_read(tmp_path):
    """page_cache.populate fills the page-table entries of the ranges given (MADV_POPULATE_READ): a mapping that no
    one has read is then resident in this process (smaps' Rss), without a read; ranges are merged and rounded out."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * (32 * 1024))                           # 8 MiB
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)                 # as Checkpoint maps (never written)
    anchor = ctypes.c_char.from_buffer(m)
    try:
        base, page, mib = ctypes.addressof(anchor), mmap.PAGESIZE, 2**20      # a mapping starts on a page
        before, _ = page_cache.mapped_pages([path])
        done = page_cache.populate([(base + 4 * mib, 4 * mib), (base + 10, 1000), (base + 500, mib)])
        if done is None:
            pytest.skip("this kernel has no MADV_POPULATE_READ (Linux 5.14)")
        after, _ = page_cache.mapped_pages([path])
        assert done == 5 * mib + page                  # [0, 1 MiB + a page) merged and rounded out, [4, 8) MiB
        assert after - before >= 5 * mib, (before, after)
        assert page_cache.populate([]) == 0
    finally:
        del anchor
        m.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise and /proc/self/smaps")
def test_experts_in_place_are_mapped_once_the_engine_serves(oracles):
    """The in-process engine maps every page of its experts in place in a thread once it serves (the first
    requests after a start faulted on each expert they met): by then they are resident in the process."""
    from tests.inprocess import InProcess

    with InProcess(oracles["qwen3_moe"].path, cpu_forms="off") as engine:
        shard = engine.shard
        assert shard.in_place and shard._populating is not None
        shard._populating.join(timeout=60)
        if shard.populate() is None:
            pytest.skip("this kernel has no MADV_POPULATE_READ (Linux 5.14)")
        ranges = [(t.data_ptr(), t.numel() * t.element_size()) for w in (*shard.w13.values(), *shard.w2.values())
                  for t in w.flat]
        rss, _ = page_cache.mapped_pages(sorted(shard.watch.stamps))
        assert rss >= sum(n for _, n in ranges) - len(ranges) * mmap.PAGESIZE, rss
