"""A safetensors file's header, parsed and checked before any tensor is read: each tensor's dtype, shape and byte
range (every problem names the tensor and the file), and the index of a checkpoint split over several files.
Torch-free; checkpoint.py maps the files and views the tensors.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from colibri_common.errors import CheckpointError

ITEM_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "F8_E4M3": 1}   # the dtypes read

INTEGER_DTYPES = ("I64", "I32", "U8")


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: Path
    dtype: str            # safetensors dtype code, e.g. "BF16"
    shape: tuple[int, ...]
    start: int            # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


# Headers parsed in this process, by the file's identity when it was read: a process reads a checkpoint's headers
# several times as it starts (serve checks the files before it forks, the router builds two Checkpoints), and a
# forked child inherits what its parent parsed. A replaced or rewritten file has another identity and is read again.
# Bounded: a long-lived process that opens many checkpoints (a test run) keeps the last few.
_PARSED: dict[tuple[str, int, int, int, int, int], dict[str, TensorEntry]] = {}
_PARSED_MAX = 16


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The file's tensors by name (a fresh dict: callers may add to it); every problem raises CheckpointError."""
    st = path.stat()
    key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    parsed = _PARSED.get(key)
    if parsed is None:
        parsed = _parse(path, st.st_size)
        while len(_PARSED) >= _PARSED_MAX:
            _PARSED.pop(next(iter(_PARSED)), None)
        _PARSED[key] = parsed
    return dict(parsed)


def _parse(path: Path, size: int) -> dict[str, TensorEntry]:
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file (no header)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100 * 2**20:
            raise CheckpointError(f"{path}: header length {n} exceeds the file size {size}; file truncated?")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    base = 8 + n
    out: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (lo, hi) = _header_entry(path, name, info)
        if dtype not in ITEM_BYTES:
            raise CheckpointError(f"{path}: tensor '{name}' has unsupported dtype {dtype}")
        if not 0 <= lo <= hi:
            raise CheckpointError(f"{path}: tensor '{name}' has byte range {lo}..{hi}, outside the data section; "
                                  f"the file is corrupt, export it again")
        numel = 1
        for d in shape:
            numel *= d
        if hi - lo != numel * ITEM_BYTES[dtype]:
            raise CheckpointError(f"{path}: tensor '{name}' shape {list(shape)} {dtype} does not match its "
                                  f"byte range {lo}..{hi}")
        if base + hi > size:
            raise CheckpointError(f"{path}: tensor '{name}' ends at byte {base + hi} but the file has only "
                                  f"{size} bytes; the file is truncated, download it again")
        out[name] = TensorEntry(name, path, dtype, shape, base + lo, base + hi)
    _check_layout(path, out, base, size)
    return out


def _header_entry(path: Path, name: str, info: object) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """A header entry's dtype, shape and data offsets, their types checked."""
    try:
        dtype, shape, offsets = info["dtype"], tuple(info["shape"]), tuple(info["data_offsets"])  # type: ignore[index]
    except (TypeError, KeyError) as exc:
        raise CheckpointError(f"{path}: tensor '{name}' has a malformed header entry {info!r}") from exc
    ints = lambda xs: all(type(x) is int for x in xs)       # noqa: E731  (bool is no size)
    if not isinstance(dtype, str) or not ints(shape) or any(d < 0 for d in shape) or len(offsets) != 2 \
            or not ints(offsets):
        raise CheckpointError(f"{path}: tensor '{name}' has a malformed header entry {info!r}")
    return dtype, shape, (offsets[0], offsets[1])


def _check_layout(path: Path, entries: dict[str, TensorEntry], base: int, size: int) -> None:
    """The safetensors library's rule: the tensors, in offset order, tile the data section exactly (no byte
    shared by two tensors, none that belongs to no tensor). A file that breaks it is refused, naming the tensors."""
    corrupt = "the file is corrupt (the safetensors library refuses it too), export it again"
    end, prev = base, "the start of the data section"
    for e in sorted(entries.values(), key=lambda e: (e.start, e.end, e.name)):
        span = f"tensor '{e.name}' (data bytes {e.start - base}..{e.end - base})"
        if e.start < end:
            raise CheckpointError(f"{path}: {prev} and {span} overlap; {corrupt}")
        if e.start > end:
            raise CheckpointError(f"{path}: {e.start - end} bytes between {prev} and {span} belong to no tensor; "
                                  f"{corrupt}")
        end, prev = e.end, span
    if end != size:
        raise CheckpointError(f"{path}: {size - end} bytes after {prev} to the end of the file belong to no tensor; "
                              f"{corrupt}")


def read_index(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's tensor -> file map, or a CheckpointError naming the index and what is wrong
    (garbage was a JSONDecodeError, a missing key a KeyError, a list a TypeError)."""
    try:
        doc = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{index}: not a readable JSON index ({str(exc).splitlines()[0]})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) and v
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: needs a 'weight_map' object of tensor names to file names (strings)")
    if any("/" in v or v in (".", "..") for v in weight_map.values()):
        raise CheckpointError(f"{index}: 'weight_map' names files outside the checkpoint directory; give plain "
                              f"file names")
    return weight_map
