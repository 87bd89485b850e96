"""Safetensors checkpoints read through mmap: headers parsed by safetensors_header.py, tensors as views over the
mapping.

A tensor view touches no bytes until it is used, so an expert worker's resident memory tracks the
experts it reads, not the files it maps. Every problem names the tensor and the file.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from colibri_common import page_cache
from colibri_common.errors import CheckpointError
from colibri_common.file_watch import Stamp
from colibri_common.fp8 import Fp8Format
from colibri_common.safetensors_header import INTEGER_DTYPES, TensorEntry, read_header, read_index
from kernels import fp8, mxfp4

_ST_DTYPES: dict[str, torch.dtype] = {          # the header's dtype codes (safetensors_header.ITEM_BYTES) in torch
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "F8_E4M3": torch.float8_e4m3fn,
}


def checkpoint_id(fingerprint: str) -> int:
    """The 64 bits of a Checkpoint.fingerprint() that every ForwardRequest carries (0 = none: not checked)."""
    return int(fingerprint[:16], 16) | 1 if fingerprint else 0


class Checkpoint:
    """All tensors of a checkpoint directory, mapped lazily, file by file."""

    def __init__(self, model_dir: str | Path) -> None:
        self.dir = Path(model_dir)
        self.fp8 = Fp8Format.from_dir(self.dir)      # block-scaled FP8 weights, dequantised as they are read
        self.entries: dict[str, TensorEntry] = {}
        self._maps: dict[Path, mmap.mmap] = {}
        self.stamps: dict[Path, Stamp] = {}           # each mapped file's identity when it was mapped
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_index(index)
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = {}
        if not files and self.dir.is_dir() and not os.access(self.dir, os.R_OK):
            raise CheckpointError(f"{self.dir}: permission denied to list it (its files are found by listing it): "
                                  f"give this user (uid {os.getuid()}) read access to the directory")
        if not files:
            bins = sorted(p.name for p in self.dir.glob("*.bin"))[:2]
            raise CheckpointError(f"{self.dir}: no *.safetensors files found" + (
                f" ({', '.join(bins)}: PyTorch pickles, which are not mapped; convert them once with transformers: "
                f"AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR, safe_serialization=True))"
                if bins else ""))
        for fname in files:
            path = self.dir / fname
            if not path.is_file():
                raise CheckpointError(f"{index}: names {fname}, which is missing from {self.dir}"
                                      if weight_map and not (path.exists() or path.is_symlink()) else
                                      f"{path}: not a regular file (a directory, or a link to nothing)")
            for name, entry in read_header(path).items():
                other = self.entries.get(name)
                # a tensor in two files: the index says which; without one, no file may be taken over another
                if other is not None and not weight_map:
                    raise CheckpointError(f"{self.dir}: tensor '{name}' is stored in both {other.file.name} and "
                                          f"{fname}; remove the file that should not be there (or list each tensor's "
                                          f"file in a model.safetensors.index.json)")
                if other is None or weight_map.get(name) == fname:
                    self.entries[name] = entry
        for name, fname in weight_map.items():    # (one stored in another of its files is read, as transformers)
            if name not in self.entries:
                raise CheckpointError(f"{index}: tensor '{name}' is listed in {fname} but stored in none of the files "
                                      f"the index names")

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def fingerprint(self, samples: int = 256) -> str:
        """What tells two checkpoints apart, cheaply: every tensor's name, dtype and shape, and the first and last
        64 bytes of up to `samples` of them (spread over the sorted names; two trainings or seeds of one shape
        differ in every tensor), read with pread (no mapping). The router and its workers compare theirs: a
        worker on another checkpoint of the same shapes added its experts silently into the wrong model."""
        h = hashlib.blake2b(digest_size=16)
        names = sorted(self.entries)
        for name in names:
            e = self.entries[name]
            h.update(f"{name}|{e.dtype}|{list(e.shape)}\n".encode())
        fds: dict[Path, int] = {}
        try:
            for name in names[::max(1, len(names) // samples)]:
                e = self.entries[name]
                if e.file not in fds:
                    fds[e.file] = os.open(e.file, os.O_RDONLY)
                for start in dict.fromkeys((e.start, max(e.start, e.end - 64))):
                    h.update(os.pread(fds[e.file], min(64, e.end - start), start))
        except OSError as exc:
            raise CheckpointError(f"{self.dir}: cannot read a tensor's bytes: {exc}") from exc
        finally:
            for fd in fds.values():
                os.close(fd)
        return h.hexdigest()

    def entry(self, name: str) -> TensorEntry:
        if name not in self.entries:
            raise CheckpointError(f"{self.dir}: missing tensor '{name}'")
        return self.entries[name]

    def check(self, name: str, shape: tuple[int, ...]) -> TensorEntry:
        """A tensor the model reads, with the shape the config gives it, stored as numbers it can read: floats, FP8,
        or MXFP4's byte blocks and scales (an integer weight, such as a quantised export's without its scales,
        was taken as raw integers and served silently wrong tokens)."""
        e = self.entry(name)
        if e.shape != tuple(shape):
            raise CheckpointError(f"{e.file}: tensor '{name}' has shape {list(e.shape)}, the config needs "
                                  f"{list(shape)}")
        if e.dtype in INTEGER_DTYPES and not (e.dtype == "U8" and name.endswith(("_blocks", "_scales"))):
            raise CheckpointError(f"{e.file}: tensor '{name}' is stored as {e.dtype}, where the model reads a float "
                                  f"weight (F32, BF16, F16, F64 or FP8 with its scales): a quantised export "
                                  f"whose format this loader does not read?")
        return e

    def _map(self, path: Path) -> mmap.mmap:
        if path not in self._maps:
            fd = os.open(path, os.O_RDONLY)
            try:
                # ACCESS_COPY: private, writable pages (no torch warning), shared until written; we never write.
                self._maps[path] = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
                st = os.fstat(fd)                           # the identity of what is mapped (FileWatch)
                self.stamps[path] = Stamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
                page_cache.advise_huge(self._maps[path])    # a fault on bytes not cached reads a 2 MiB folio
            finally:
                os.close(fd)
        return self._maps[path]

    def map_all(self) -> None:
        """Map every file now (a reader that maps lazily from several threads could map one twice)."""
        for e in self.entries.values():
            self._map(e.file)

    def view(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A zero-copy tensor over the mapped bytes (no page is read until used)."""
        e = self.check(name, shape) if shape is not None else self.entry(name)
        dtype = _ST_DTYPES[e.dtype]
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=dtype)
        buf = self._map(e.file)
        return torch.frombuffer(buf, dtype=dtype, offset=e.start, count=e.nbytes // dtype.itemsize
                                ).view(e.shape)

    def _range(self, name: str, index: int | None) -> tuple[TensorEntry, int, int]:
        """The byte range of a tensor, or of its slice `index` along the first dimension (one expert of a
        fused [E, ...] tensor)."""
        e = self.entry(name)
        if index is None:
            return e, e.start, e.end
        if not e.shape or not 0 <= index < e.shape[0]:
            raise CheckpointError(f"{e.file}: tensor '{name}' {list(e.shape)} has no slice {index}")
        step = e.nbytes // e.shape[0]
        return e, e.start + index * step, e.start + (index + 1) * step

    def _advise(self, name: str, index: int | None, advice: int, whole_pages_only: bool) -> None:
        e, start, end = self._range(name, index)
        m = self._maps.get(e.file)
        if m is None:
            return
        if whole_pages_only:                                    # never drop a page a neighbour still uses
            lo, hi = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
        else:
            lo, hi = start // mmap.PAGESIZE * mmap.PAGESIZE, -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
            hi = min(hi, len(m))
        if hi > lo:
            m.madvise(advice, lo, hi - lo)

    def release(self, name: str, index: int | None = None) -> None:
        """Drop the resident pages of a tensor (or of its slice `index`) already copied out (MADV_DONTNEED on
        its whole pages), so a worker's RSS stays near what it packs. A later view reads the file again."""
        if hasattr(mmap, "MADV_DONTNEED"):
            self._advise(name, index, mmap.MADV_DONTNEED, True)

    def will_need(self, name: str, index: int | None = None) -> None:
        """Ask the kernel to read a tensor's (or slice's) pages ahead, off the critical path (MADV_WILLNEED)."""
        if hasattr(mmap, "MADV_WILLNEED"):
            self._map(self.entry(name).file)
            self._advise(name, index, mmap.MADV_WILLNEED, False)

    def tensor(self, name: str, shape: tuple[int, ...] | None = None, index: int | None = None) -> torch.Tensor:
        """The tensor's real values (slice `index` of its first dimension when given): the zero-copy view, or
        for an FP8 weight with block scales its dequantised float32 values (read from the map as needed)."""
        t = self.view(name, shape)
        if t.dtype != torch.float8_e4m3fn:
            return t if index is None else t[index]
        scales = name + fp8.SCALE_SUFFIX
        if self.fp8 is None or scales not in self.entries:
            raise CheckpointError(f"{self.entry(name).file}: tensor '{name}' is FP8 but "
                                  + ("config.json has no fp8 quantization_config" if self.fp8 is None
                                     else f"its scales '{scales}' are missing"))
        s = self.view(scales)
        w, s = (t, s) if index is None else (t[index], s[index])
        try:
            return fp8.dequantize(w, s, self.fp8.block)
        except ValueError as exc:
            raise CheckpointError(f"{self.entry(name).file}: '{name}': {exc}") from exc

    def mxfp4(self, blocks: str, scales: str, index: int | None = None) -> torch.Tensor:
        """An MXFP4 weight's float32 values [R, C] (slice `index` of the layer's experts), from its blocks and
        scales (read from the map as needed)."""
        b, s = self.view(blocks), self.view(scales)
        if index is not None:
            b, s = b[index], s[index]
        try:
            return mxfp4.dequantize(b, s)
        except ValueError as exc:
            raise CheckpointError(f"{self.entry(blocks).file}: '{blocks}' and '{scales}': {exc}") from exc

    def check_fp8(self, name: str) -> None:
        """An FP8 weight's block scales exist with the shape its blocks need (headers only)."""
        e = self.entry(name)
        scales = name + fp8.SCALE_SUFFIX
        if self.fp8 is None:
            raise CheckpointError(f"{e.file}: tensor '{name}' is FP8 but config.json has no fp8 "
                                  f"quantization_config")
        b0, b1 = self.fp8.block
        want = (*e.shape[:-2], -(-e.shape[-2] // b0), -(-e.shape[-1] // b1))
        self.check(scales, want)

    def quantized(self) -> dict[str, int]:
        """What quantised weights the checkpoint holds: format -> tensor count (empty for plain floats)."""
        out = {}
        n = sum(1 for e in self.entries.values() if e.dtype == "F8_E4M3")
        if n:
            b0, b1 = self.fp8.block if self.fp8 else (0, 0)
            out[f"fp8 e4m3, {b0}x{b1} block scales"] = n
        n = sum(1 for name, e in self.entries.items() if name.endswith("_blocks") and e.dtype == "U8")
        if n:
            out[f"mxfp4 e2m1, {mxfp4.BLOCK}-value blocks with e8m0 scales"] = n
        return out

    def load(self, name: str, shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None
             ) -> torch.Tensor:
        """An owned copy (for the router's dense weights), converted to `dtype` (FP8 dequantised first)."""
        t = self.tensor(name, shape)
        return t.to(dtype=dtype or t.dtype, copy=True)

    def close(self, keep: Iterable[Path] = ()) -> None:
        """Unmap every file but `keep` (those whose views are used in place); other views handed out earlier must
        be gone (copied) by now."""
        import gc

        collected = False
        kept = {Path(p) for p in keep}
        for path, m in list(self._maps.items()):
            if path in kept:
                continue
            try:
                m.close()
            except BufferError:
                if not collected:        # a view may be held only by a cycle: one collection, then retry
                    gc.collect()         # (not up front: it takes 0.3 s in a process with a large heap)
                    collected = True
                try:
                    m.close()
                except BufferError:
                    logging.getLogger("colibri").warning("%s stays mapped: a tensor view is still alive", path)
                    continue
            del self._maps[path]
