"""A full cache disk: the atomic writers (the CPU forms file, a worker's heat file) remove their temp file when a
write fails, say so in one warning naming the file and the error, and go on with what they hold in memory."""

from __future__ import annotations

import errno
import logging
import os

import pytest

from colibri_common import forms_file
from colibri_common.forms_file import FormsFile, write_atomic
from expert_service import heat_file

FAILURES = {"ENOSPC": errno.ENOSPC, "EDQUOT": errno.EDQUOT, "EIO": errno.EIO}


@pytest.fixture(params=["write", "close", "replace", "mkstemp"])
def full_disk(request, monkeypatch):
    """Make the temp file's creation, write, flush at close or rename fail with ENOSPC."""
    step = request.param
    fail = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    real_fdopen = os.fdopen

    def raise_(*_a, **_k):
        raise fail

    def fdopen(fd, *a, **k):
        f = real_fdopen(fd, *a, **k)
        if step == "write":
            f.write = raise_
        elif step == "close":                 # buffered: the bytes reach the disk (and fail) at close
            real_close = f.close

            def close():
                real_close()
                raise fail
            f.close = close
        return f

    monkeypatch.setattr(forms_file.os, "fdopen", fdopen)
    if step == "replace":
        monkeypatch.setattr(forms_file.os, "replace", raise_)
    if step == "mkstemp":
        monkeypatch.setattr(forms_file.tempfile, "mkstemp", raise_)
    return step


def leftovers(d) -> list[str]:
    return sorted(p.name for p in d.iterdir() if ".tmp" in p.name)


@pytest.mark.parametrize("code", FAILURES.values(), ids=FAILURES.keys())
def test_write_atomic_removes_its_temp_file_and_keeps_the_old_file(tmp_path, monkeypatch, code):
    target = tmp_path / "f.json"
    target.write_text("old")

    def raise_(*_a, **_k):
        raise OSError(code, os.strerror(code))

    real_fdopen = os.fdopen

    def fdopen(fd, *a, **k):
        f = real_fdopen(fd, *a, **k)
        f.write = raise_
        return f

    monkeypatch.setattr(forms_file.os, "fdopen", fdopen)
    with pytest.raises(OSError) as err:
        write_atomic(target, "new")
    assert err.value.errno == code
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"] and target.read_text() == "old"


def test_write_atomic_writes_the_whole_file(tmp_path):
    write_atomic(tmp_path / "f.json", "x" * 100_000)
    assert (tmp_path / "f.json").read_text() == "x" * 100_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_the_forms_file_on_a_full_disk_warns_once_and_keeps_its_forms(tmp_path, full_disk, caplog):
    path = tmp_path / "cpu-forms.json"
    ff = FormsFile(path, "test")
    ff.forms["1024x1024:float32:1"] = "mv"
    with caplog.at_level(logging.WARNING, logger="colibri"):
        ff.save()                                                        # no exception escapes
    assert leftovers(tmp_path) == [] and not path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu-forms.lock"]     # the lock, no temp file
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "No space left on device" in warnings[0], warnings
    assert ff.forms == {"1024x1024:float32:1": "mv"}                     # still in use from memory


def test_the_heat_file_on_a_full_disk_warns_once(tmp_path, full_disk, caplog):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    path = tmp_path / "cache" / "expert-heat.json"
    with caplog.at_level(logging.WARNING, logger="colibri.expert"):
        heat_file.save(path, model, [(0, 1), (2, 3)])                    # no exception escapes
    assert list(path.parent.iterdir()) == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "No space left on device" in warnings[0], warnings


def test_the_heat_file_round_trips(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"")
    path = tmp_path / "cache" / "expert-heat.json"
    heat_file.save(path, model, [(0, 1), (2, 3)])
    assert heat_file.load(path, model) == [(0, 1), (2, 3)]
    assert [p.name for p in path.parent.iterdir()] == ["expert-heat.json"]
