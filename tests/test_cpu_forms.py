"""The CPU linear forms: every form computes x @ W.T, the measured winners are kept in a file keyed by the
machine, reused on the next start, rebuilt for another CPU or torch or a corrupt file."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from colibri_common.forms_file import machine
from kernels import cpu_forms, cpu_moe, cpu_tune
from kernels.cpu_linear import linear
from kernels.quant import quantize_int8
from tests.conftest import colibri_run
from tests.inprocess import InProcess

torch.set_num_threads(1)


@pytest.mark.parametrize("weight, act", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                         ("int8", torch.float32), ("int8", torch.bfloat16)])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_every_form_computes_the_same_product(weight, act, rows):
    g = torch.Generator().manual_seed(rows)
    x, wf, b = torch.randn(rows, 72, generator=g).to(act), torch.randn(40, 72, generator=g), \
        torch.randn(40, generator=g).to(act)
    w = quantize_int8(wf) if weight == "int8" else wf.to(act)
    exact = w.dequantize(torch.float64) if weight == "int8" else w.double()   # the product of what is held
    want = F.linear(x.double(), exact, b.double())
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[act] if weight != "int8" else \
        {torch.float32: 2e-2, torch.bfloat16: 4e-2}[act]                      # int8 forms may quantise x too
    k = cpu_forms.kind(w, act)
    names = cpu_forms.candidates(k, cpu_forms.bucket(rows))
    assert names
    for name in names:
        cpu_forms.install({cpu_forms.key(40, 72, k, cpu_forms.bucket(rows)): name})
        got = linear(x, w, b)
        assert got.dtype == act and got.shape == (rows, 40)
        assert float((got.double() - want).abs().max() / want.abs().max()) < tol, name


def test_measure_fills_only_what_is_missing_and_picks_a_candidate():
    table = {cpu_forms.key(64, 32, "float32", 1): "linear"}          # already known: not measured again
    shapes = [(64, 32, "float32"), (64, 32, "float32"), (48, 32, "int8-bfloat16")]
    measured = cpu_forms.measure(shapes, table, max_rows=8, min_seconds=0.001)
    assert measured == [cpu_forms.key(64, 32, "float32", b) for b in (2, 4, 8)] + \
        [cpu_forms.key(48, 32, "int8-bfloat16", b) for b in (1, 2, 4, 8)]
    assert table[cpu_forms.key(64, 32, "float32", 1)] == "linear"
    for k in measured:
        shape_kind, rows = k.rsplit(":", 1)
        assert table[k] in cpu_forms.candidates(shape_kind.split(":")[1], int(rows))
    with pytest.raises(ValueError, match="unknown CPU linear forms"):
        cpu_forms.install({"1x1:float32:1": "magic"})


def start(path, oracles, caplog) -> str:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="colibri"), \
            InProcess(oracles["olmoe"].path, cpu_forms=str(path)) as engine:
        assert len(engine.generate([1, 2, 3], 3).token_ids) == 3
    return next(r.getMessage() for r in caplog.records if "CPU linear forms" in r.getMessage())


def test_written_on_first_start_reused_on_the_second_rebuilt_for_another_machine(tmp_path, oracles, caplog):
    path = tmp_path / "forms.json"
    first = start(path, oracles, caplog)
    assert "0 reused and" in first and " 0 measured" not in first
    saved = json.loads(path.read_text())
    assert saved["machine"] == machine()
    name = f"threads={torch.get_num_threads()} forms={cpu_tune.CANDIDATES}"
    section = saved["forms"][name]
    assert section and set(section.values()) <= set(cpu_forms.FORMS) | set(cpu_moe.MOE_FORMS)

    second = start(path, oracles, caplog)
    assert f"{len(section)} reused and 0 measured" in second

    saved["forms"] = {name.replace("+int8_pack_bf16", ""): section}     # chosen among fewer forms: measured again
    path.write_text(json.dumps(saved))
    assert "0 reused and" in start(path, oracles, caplog)

    saved["machine"]["torch"] = "1.0.0"                              # another torch (or CPU): ignored, rebuilt
    path.write_text(json.dumps(saved))
    third = start(path, oracles, caplog)
    assert "0 reused and" in third
    assert any("was measured on" in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text())["machine"] == machine()


def test_a_corrupt_file_is_rebuilt_with_a_warning(tmp_path, oracles, caplog):
    path = tmp_path / "forms.json"
    path.write_text("{not json")
    msg = start(path, oracles, caplog)
    assert "0 reused and" in msg
    assert any(r.levelno == logging.WARNING and "corrupt" in r.getMessage() for r in caplog.records)
    assert json.loads(path.read_text())["machine"] == machine()


def test_entries_that_make_no_sense_are_measured_again():
    table = {cpu_forms.key(48, 32, "int8-float32", 1): "linear", "garbage": "mv"}   # a float form for int8
    measured = cpu_tune.tune([(48, 32, "int8-float32")], table, save=lambda: None, max_rows=1)
    assert measured == [cpu_forms.key(48, 32, "int8-float32", 1)] and "garbage" not in table
    assert table[measured[0]] in cpu_forms.INT8_FORMS


def test_the_moe_form_is_raced_per_row_bucket_and_kept_with_the_linear_forms():
    shapes = [cpu_tune.MoeShape(6, 24, 40, 2, "bfloat16"), cpu_tune.MoeShape(6, 24, 40, 2, "int8-float32")]
    table = {cpu_moe.moe_key(6, 24, 40, "bfloat16", 1): "loop", cpu_moe.moe_key(6, 24, 40, "float32", 2): "magic"}
    saved = []
    measured = cpu_tune.tune([], table, save=lambda: saved.append(1), max_rows=4, moe=shapes)
    assert measured == [cpu_moe.moe_key(6, 24, 40, "bfloat16", b) for b in (2, 4)]   # int8 has one form only
    assert saved and cpu_moe.moe_key(6, 24, 40, "float32", 2) not in table        # the nonsense entry is gone
    assert all(table[k] in cpu_moe.MOE_FORMS for k in measured)
    x, w13 = torch.empty(3, 40, dtype=torch.bfloat16), torch.empty(6, 48, 40, dtype=torch.bfloat16)
    assert cpu_moe.pick_moe(x, w13) == table[cpu_moe.moe_key(6, 24, 40, "bfloat16", 4)]   # installed
    with pytest.raises(ValueError, match="pairs <= experts"):
        cpu_tune.MoeShape(2, 24, 40, 3, "bfloat16")


def test_off_measures_nothing_and_auto_uses_the_cache_dir(tmp_path, oracles, monkeypatch, caplog):
    monkeypatch.setenv("COLIBRI_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="colibri"), InProcess(oracles["olmoe"].path, cpu_forms="off") as e:
        assert len(e.generate([1, 2, 3], 3).token_ids) == 3
    assert not any("CPU linear forms" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "cpu-forms.json").exists()
    with InProcess(oracles["olmoe"].path, cpu_forms="auto") as e:
        assert len(e.generate([1, 2, 3], 3).token_ids) == 3
    assert json.loads((tmp_path / "cpu-forms.json").read_text())["machine"] == machine()


def test_tune_cli_writes_the_file_the_services_read(tmp_path, oracles):
    path = tmp_path / "tuned.json"
    out = colibri_run(["tune", "--model", str(oracles["qwen3_moe"].path), "--workers", "2", "--cpu-forms", str(path),
                       "--max-rows", "4"])
    assert out.returncode == 0, out.stderr
    assert "router (" in out.stdout and "expert worker (" in out.stdout
    sections = json.loads(path.read_text())["forms"]
    assert sections and all(sections.values())
    assert any(k.startswith("moe:") for forms in sections.values() for k in forms)   # the worker's MoE form


def test_the_workers_of_a_fleet_measure_their_shared_shapes_once(tmp_path, oracles):
    """Two workers with the same shapes start at once on a new file: one measures (holding the file's measuring
    lock), the other waits for it and reuses every form, instead of racing it on the same cores. Two cores:
    the router (two threads) keeps a section of its own, the workers (one thread each) share one."""
    import signal
    import subprocess

    from tests.conftest import colibri_popen

    path = tmp_path / "fleet.json"
    p = colibri_popen(["serve", "--model", str(oracles["olmoe"].path), "--workers", "2", "--port", "0",
                       "--threads", "2", "--cpu-forms", str(path), "--log-level", "INFO"], stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline().startswith("ready ")
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    lines = [line for line in err.splitlines() if "expert[" in line and "CPU linear forms" in line]
    assert len(lines) == 2, err[-3000:]
    counts = sorted((int(line.split(": ")[-1].split()[0]), int(line.split(" and ")[1].split()[0])) for line in lines)
    (reused0, measured0), (reused1, measured1) = counts                 # (reused, measured), fewest reused first
    assert reused0 == 0 and measured0 > 0, lines                         # the first measured everything
    assert (reused1, measured1) == (measured0, 0), lines                 # the second reused all of it
