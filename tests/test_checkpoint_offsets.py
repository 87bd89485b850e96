"""A safetensors file whose tensors do not tile its data section exactly (overlapping byte ranges, bytes that
belong to no tensor, ranges outside the file, sizes that do not match dtype x shape) is refused by name, as the
safetensors library refuses it, at start and by `colibri validate`; a normal file still loads."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open

from colibri_common.checkpoint import Checkpoint
from colibri_common.errors import CheckpointError
from tests.conftest import colibri_run


def write(path: Path, header: dict, data: bytes) -> Path:
    """A safetensors file written by hand: 8-byte header length, the header JSON, the data section."""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def f32(lo: int, hi: int, *shape: int) -> dict:
    return {"dtype": "F32", "shape": list(shape), "data_offsets": [lo, hi]}


# name: (header, data length, the two tensors the message names, or () where only the file is certain)
BAD = {
    "overlap": ({"a": f32(0, 8, 2), "b": f32(4, 12, 2)}, 16, ("'a'", "'b'")),
    "same range": ({"a": f32(0, 8, 2), "b": f32(0, 8, 2)}, 8, ("'a'", "'b'")),
    "gap": ({"a": f32(0, 8, 2), "b": f32(12, 20, 2)}, 20, ("'a'", "'b'")),
    "leading gap": ({"a": f32(4, 12, 2)}, 12, ("'a'", "start of the data section")),
    "trailing bytes": ({"a": f32(0, 8, 2)}, 12, ("'a'", "to the end of the file")),
    "empty tensor inside another": ({"a": f32(0, 8, 2), "b": f32(4, 4, 0)}, 8, ("'a'", "'b'")),
    "reversed range": ({"a": f32(8, 0, 0)}, 8, ("'a'", "outside the data section")),
    "negative offset": ({"a": f32(-4, 4, 2)}, 8, ("'a'", "outside the data section")),
    "size not dtype x shape": ({"a": f32(0, 12, 2)}, 12, ("'a'", "does not match")),
    "past the end": ({"a": f32(0, 8, 2), "b": f32(8, 16, 2)}, 12, ("'b'", "truncated")),
    "malformed entry": ({"a": {"dtype": "F32", "shape": [2]}}, 8, ("'a'", "malformed")),
}
GOOD = {
    "plain": ({"a": f32(0, 8, 2), "b": f32(8, 24, 2, 2)}, 24),
    "header order is not offset order": ({"b": f32(8, 16, 2), "a": f32(0, 8, 2), "__metadata__": {"x": "y"}}, 16),
    "empty tensor at the end": ({"a": f32(0, 8, 2), "b": f32(8, 8, 0)}, 8),
}


@pytest.mark.parametrize("case", BAD)
def test_a_file_whose_tensors_do_not_tile_its_data_is_refused_by_name(tmp_path, case):
    header, n, said = BAD[case]
    f = write(tmp_path / "model.safetensors", header, bytes(n))
    with pytest.raises(CheckpointError) as err:
        Checkpoint(tmp_path)
    assert str(f) in str(err.value)
    for words in said:
        assert words in str(err.value), str(err.value)
    with pytest.raises(SafetensorError), safe_open(str(f), "pt"):     # the library's policy, matched
        pass


@pytest.mark.parametrize("case", GOOD)
def test_a_well_formed_file_still_loads(tmp_path, case):
    header, n = GOOD[case]
    data = torch.arange(n // 4, dtype=torch.float32).numpy().tobytes()
    f = write(tmp_path / "model.safetensors", header, data)
    ckpt = Checkpoint(tmp_path)
    with safe_open(str(f), "pt") as st:
        assert sorted(st.keys()) == sorted(ckpt.entries)
        for name in st.keys():
            assert torch.equal(ckpt.load(name), st.get_tensor(name))
    ckpt.close()


def overlapping_copy(src: Path, dst: Path) -> tuple[Path, str, str]:
    """A copy of a real checkpoint whose header points one tensor at the bytes of an earlier one of the same
    dtype and size (the data section unchanged)."""
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    entries = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
    (first, a), (_, b) = next(((x, y) for x, y in zip(entries, entries[1:], strict=False)
                               if header[x[1]]["dtype"] == header[y[1]]["dtype"]
                               and header[x[1]]["shape"] == header[y[1]]["shape"]))
    header[b]["data_offsets"] = first
    write(f, header, raw[8 + n:])
    return f, a, b


def test_validate_and_a_worker_refuse_overlapping_offsets(oracles, tmp_path):
    f, a, b = overlapping_copy(oracles["qwen3_moe"].path, tmp_path / "m")
    for args in (["validate", "--model", str(tmp_path / "m")],
                 ["expert", "--model", str(tmp_path / "m"), "--shard", "0/2", "--port", "0"],
                 ["serve", "--model", str(tmp_path / "m"), "--workers", "1", "--port", "0"]):
        out = colibri_run(args, timeout=120)
        assert out.returncode != 0, (args, out.stderr)
        assert "Traceback" not in out.stderr
        assert str(f) in out.stderr and f"'{a}'" in out.stderr and f"'{b}'" in out.stderr, out.stderr
        assert "overlap" in out.stderr


def test_a_header_is_parsed_once_per_file_and_read_again_once_the_file_is_rewritten(tmp_path, monkeypatch):
    """serve checks the files, the router builds two Checkpoints and a forked child inherits what its parent parsed:
    one parse per file identity. A file rewritten at the same path (same size, new bytes) is parsed again, and each
    caller gets a dict of its own."""
    from colibri_common import safetensors_header

    parses = []
    real = safetensors_header._parse
    monkeypatch.setattr(safetensors_header, "_parse", lambda path, size: parses.append(path) or real(path, size))
    data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
    f = write(tmp_path / "model.safetensors", {"a": f32(0, 8, 2), "b": f32(8, 16, 2)}, data)
    first = safetensors_header.read_header(f)
    first.pop("a")                                              # the caller's own dict: the next one is whole
    assert sorted(safetensors_header.read_header(f)) == ["a", "b"] and len(parses) == 1
    f.unlink()                                                  # a new file at the path: b before a, same size
    write(f, {"b": f32(0, 8, 2), "a": f32(8, 16, 2)}, data)
    again = Checkpoint(tmp_path)
    assert len(parses) == 2 and again.entries["b"].start < again.entries["a"].start
    assert torch.equal(again.load("a"), torch.tensor([2.0, 3.0]))
    again.close()
    write(f, {"a": f32(0, 8, 2), "b": f32(8, 12, 1)}, data)   # rewritten in place, smaller: refused, not reused
    with pytest.raises(CheckpointError, match="to the end of the file|does not match"):
        Checkpoint(tmp_path)
