"""The CPU linear forms: every form computes x @ W.T, the measured winners are kept in a file keyed by the
machine, reused on the next start, rebuilt for another CPU or torch or a corrupt file."""

from __future__ import annotations

import json
import logging
import re
import time

import pytest
import torch

from colibri_common.forms_file import machine
from kernels import cpu_forms, cpu_moe, cpu_tune, native
from kernels.cpu_linear import linear
from kernels.form_check import Verdict, isolated, reference, wrong
from kernels.formats.int8 import quantize_int8
from tests.conftest import colibri_run
from tests.inprocess import InProcess

torch.set_num_threads(1)


@pytest.fixture
def forms_state():
    """The process's installed forms, rejects and batch-invariance mode, restored after the test."""
    table, rejected, forms = dict(cpu_forms._TABLE), set(cpu_forms._REJECTED), dict(cpu_forms.FORMS)
    yield
    cpu_forms._TABLE.clear()
    cpu_forms._TABLE.update(table)
    cpu_forms._REJECTED.clear()
    cpu_forms._REJECTED.update(rejected)
    cpu_forms.FORMS.clear()
    cpu_forms.FORMS.update(forms)
    cpu_forms.set_batch_invariant(False)


@pytest.fixture
def torch_forms(forms_state, monkeypatch):
    """The forms machinery over torch's forms alone, as on a machine without the native kernels."""
    for name in [n for n in cpu_forms.FORMS if n.startswith("native")]:
        cpu_forms.FORMS.pop(name)
    monkeypatch.setattr(cpu_moe, "native_serves", lambda *shape: False)


def weight_of(family: str, wf: torch.Tensor, act: torch.dtype):
    return wf.to(act) if family == "float" else quantize_int8(wf, w8a8=family == "w8a8")


@pytest.mark.parametrize("family, act", [("float", torch.float32), ("float", torch.bfloat16),
                                         ("int8", torch.float32), ("int8", torch.bfloat16),
                                         ("w8a8", torch.float32), ("w8a8", torch.bfloat16)])
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("din", [72, 64])           # 72: the width torch's int8 kernel cannot take on AVX-512
def test_every_form_computes_the_product_of_its_kind_without_lowering_precision(family, act, rows, din,
                                                                              forms_state):
    """Float32 activations stay float32 in every form (weight-only int8 included: within 1e-5 of the float64
    product of what is held); only W8A8 quantises them, and then exactly as its reference does."""
    g = torch.Generator().manual_seed(rows)
    x, wf, b = torch.randn(rows, din, generator=g).to(act), torch.randn(40, din, generator=g), \
        torch.randn(40, generator=g).to(act)
    w = weight_of(family, wf, act)
    want = reference(x, w).product + b.double()
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2}[act]
    k = cpu_forms.kind(w, act)
    names = cpu_forms.candidates(k, cpu_forms.bucket(rows), 40, din)
    assert names and all(cpu_forms.FORMS[n].family == family for n in names)
    assert ("int8_pack" in names) == (family == "int8" and din % 16 == 0)      # the guard
    for name in names:
        cpu_forms.install({cpu_forms.key(40, din, k, cpu_forms.bucket(rows)): name})
        got = linear(x, w, b)
        assert got.dtype == act and got.shape == (rows, 40)
        assert float((got.double() - want).abs().max() / want.abs().max()) < tol, name


def test_int8_bf16_on_the_odd_40x72_weight_never_reaches_the_kernel_that_reads_past_its_rows(torch_forms):
    """The shape that returned 5e17 or SIGSEGV on an AVX-512 EPYC through `_weight_int8pack_mm`: not a candidate,
    not a default, and every row count computes the right product (this runs under every ATen level the suite
    runs, AVX2 included)."""
    w = quantize_int8(torch.randn(40, 72, generator=torch.Generator().manual_seed(0)))
    for act in (torch.bfloat16, torch.float32):
        k = cpu_forms.kind(w, act)
        assert all("int8_pack" not in cpu_forms.candidates(k, b, 40, 72) for b in cpu_forms.BUCKETS)
        assert all(cpu_forms.default_form(k, b, 40, 72) == "int8_dequant" for b in cpu_forms.BUCKETS)
        for rows in (1, 2, 3, 4, 5, 17, 64, 100):
            x = torch.randn(rows, 72, generator=torch.Generator().manual_seed(rows)).to(act)
            assert wrong(linear(x, w), x, w) is None, (act, rows)


def test_measure_fills_only_what_is_missing_and_picks_a_right_candidate(forms_state):
    table = {cpu_forms.key(64, 32, "float32", 1): "linear"}          # already known: not measured again
    shapes = [(64, 32, "float32"), (64, 32, "float32"), (48, 32, "int8-bfloat16"), (48, 40, "w8a8-float32")]
    measured = cpu_tune.measure(shapes, table, max_rows=8, min_seconds=0.001)
    assert measured == [cpu_forms.key(64, 32, "float32", b) for b in (2, 4, 8)] + \
        [cpu_forms.key(48, 32, "int8-bfloat16", b) for b in (1, 2, 4, 8)] + \
        [cpu_forms.key(48, 40, "w8a8-float32", b) for b in (1, 2, 4, 8)]
    assert table[cpu_forms.key(64, 32, "float32", 1)] == "linear"
    for k in measured:
        dout, din, kind, rows = cpu_forms.parse_key(k)
        assert table[k] in cpu_forms.candidates(kind, rows, dout, din)
    assert not [k for k in table if k.startswith(cpu_tune.REJECT)]       # torch's forms are right here
    with pytest.raises(ValueError, match="unknown CPU linear forms"):
        cpu_forms.install({"1x1:float32:1": "magic"})


def _garbage(x, w):
    return torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype)        # instant, so it would win any race


def _segfault(x, w):
    import ctypes

    ctypes.string_at(0)                                              # a kernel that reads address 0
    return _garbage(x, w)


def test_a_wrong_form_is_never_chosen_and_the_table_says_why(torch_forms, caplog):
    cpu_forms.FORMS["zeros"] = cpu_forms.FormSpec(_garbage, "float")
    table: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="colibri.kernels"):
        cpu_tune.tune([(24, 40, "float32")], table, save=lambda: None, max_rows=4)
    assert "zeros" not in {v for k, v in table.items() if not k.startswith(cpu_tune.REJECT)}
    why = table[cpu_tune.reject_key(24, 40, "float32", "zeros")]
    assert "off by" in why and "against float64" in why
    assert cpu_forms.default_form("float32", 1, 24, 40) == "mv"      # the defaults never name it either
    msgs = [r.getMessage() for r in caplog.records if "zeros" in r.getMessage()]
    assert len(msgs) == 1 and torch.__version__ in msgs[0]


def test_a_form_that_crashes_is_caught_in_a_forked_child_and_marked_unusable(forms_state, caplog):
    """The probe runs in a forked child: the segfault takes down the probe, not this process; the form is
    recorded as crashed for that shape and never raced or picked."""
    cpu_forms.FORMS["crashy"] = cpu_forms.FormSpec(_segfault, "int8", isolate=True)
    table: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="colibri.kernels"):
        cpu_tune.tune([(24, 40, "int8-bfloat16")], table, save=lambda: None, max_rows=2)
    assert table[cpu_tune.reject_key(24, 40, "int8-bfloat16", "crashy")] == "crashed (SIGSEGV)"
    assert all(v != "crashy" for v in table.values())
    assert (24, 40, "int8-bfloat16", "crashy") in cpu_forms._REJECTED
    assert any("crashy" in r.getMessage() and "crashed (SIGSEGV)" in r.getMessage() for r in caplog.records)
    assert isolated(lambda: None) is None and isolated(lambda: "wrong") == Verdict("wrong")
    hung = isolated(lambda: time.sleep(30), timeout=0.5)
    assert hung.why.startswith("hung") and not hung.lasting             # maybe the load: not kept in the file
    raised = isolated(lambda: 1 / 0)
    assert raised.why.startswith("raised ZeroDivisionError") and not raised.lasting


def test_a_probe_that_crashes_once_and_not_on_the_same_inputs_again_passes(tmp_path, caplog):
    """Both children run the same inputs in a copy of the same memory: a form's own crash repeats, a crash of the
    probe's moment does not, and is not kept against the form."""
    import ctypes

    marker = tmp_path / "crashed-once"

    def once() -> None:
        if not marker.exists():
            marker.touch()
            ctypes.string_at(0)                                      # a read of address 0
        return None

    with caplog.at_level(logging.WARNING, logger="colibri.kernels"):
        assert isolated(once) is None
    assert any("crashed (SIGSEGV) once" in r.getMessage() for r in caplog.records)
    assert isolated(lambda: ctypes.string_at(0)) == Verdict("crashed (SIGSEGV)")     # every time: the form's


def test_a_reject_read_from_the_file_keeps_its_form_out_of_the_defaults_and_the_table(torch_forms):
    """A forms file that rejects this shape's default form (as another start on this machine found it wrong):
    the default falls back to the plain GEMM, and a winner naming it is dropped and measured again."""
    k = cpu_forms.key(24, 40, "float32", 1)
    table = {cpu_tune.reject_key(24, 40, "float32", "mv"): "crashed (SIGSEGV)", k: "mv"}
    measured = cpu_tune.tune([(24, 40, "float32")], table, save=lambda: None, max_rows=1)
    assert measured == [k] and table[k] != "mv"
    assert cpu_forms.default_form("float32", 1, 24, 40) == "linear"
    x, w = torch.randn(1, 40), torch.randn(24, 40)
    assert cpu_forms.pick(x, w) is not cpu_forms.FORMS["mv"].fn


def test_without_a_forms_file_the_forms_the_defaults_run_are_still_checked(torch_forms, caplog):
    """--cpu-forms off measures nothing, but a default that is wrong here is refused all the same."""
    cpu_forms.FORMS["mv"] = cpu_forms.FormSpec(_garbage, "float", max_rows=1)         # the 1-row default, broken
    table: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="colibri.kernels"):
        assert cpu_tune.tune([(24, 40, "float32")], table, save=lambda: 1 / 0, max_rows=4, timed=False) == []
    assert cpu_tune.reject_key(24, 40, "float32", "mv") in table
    assert not [k for k in table if not k.startswith(cpu_tune.REJECT)]                # nothing timed
    x, w = torch.randn(1, 40), torch.randn(24, 40)
    assert wrong(linear(x, w), x, w) is None                                          # the fallback computes it


def test_the_check_refuses_a_form_that_lowers_precision():
    """Rounding float32 activations to bf16 (what `int8_pack_bf16` did) or quantising them (what `int8_intmm`
    did under weight-only int8) is caught by the float64 comparison, whatever the shape."""
    g = torch.Generator().manual_seed(3)
    x, wf = torch.randn(5, 256, generator=g), torch.randn(64, 256, generator=g)
    w = quantize_int8(wf)
    as_bf16 = torch._weight_int8pack_mm(x.bfloat16(), w.q, w.scale.bfloat16()).float()
    as_int8 = cpu_forms.FORMS["w8a8_intmm"].fn(x, w)
    assert "against float64" in wrong(as_bf16, x, w) and "against float64" in wrong(as_int8, x, w)
    assert wrong(cpu_forms.FORMS["int8_dequant"].fn(x, w), x, w) is None
    assert "non-finite" in wrong(torch.full((5, 64), float("nan")), x, w)
    # A result that cancels to almost nothing (a one-output gate whose terms sum to ~0) is judged by the size of
    # its terms, not its own: float32 accumulation is right there even when it is far off relative to ~0.
    gate = torch.randn(1, 96, generator=g)
    xs = torch.randn(8, 96, generator=g)
    xs -= (xs @ gate.t()) / gate.square().sum() * gate * (1 - 1e-4)              # x . gate ~ 1e-4 of its terms
    for name in ("mv", "gemv_t", "linear"):
        assert wrong(cpu_forms.FORMS[name].fn(xs[:1] if name == "mv" else xs, gate), xs[:1] if name == "mv"
                     else xs, gate) is None, name
    assert "not torch.float32" in wrong(as_bf16.bfloat16(), x, w)


@pytest.mark.parametrize("family, act", [("float", torch.float32), ("float", torch.bfloat16),
                                         ("int8", torch.bfloat16), ("int8", torch.float32), ("w8a8", torch.float32)])
@pytest.mark.parametrize("din", [72, 64])
@pytest.mark.parametrize("threads", [1, 2])
def test_batch_invariance_gives_each_row_the_same_bits_at_every_row_count(family, act, din, threads, forms_state):
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(din)
        w = weight_of(family, torch.randn(48, din, generator=g), act)
        x = torch.randn(70, din, generator=g).to(act)
        cpu_forms.set_batch_invariant(True)
        alone = linear(x[:1], w)
        whole = linear(x, w)
        assert wrong(whole, x, w) is None
        for n in (1, 2, 3, 5, 8, 17, 33, 64, 70):
            assert torch.equal(linear(x[:n], w), whole[:n]), n
        assert torch.equal(alone, whole[:1])
    finally:
        torch.set_num_threads(1)


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
    assert section and {v for k, v in section.items() if not k.startswith(cpu_tune.REJECT)} <= \
        set(cpu_forms.FORMS) | set(cpu_moe.MOE_FORMS)

    second = start(path, oracles, caplog)
    assert f"{len(section)} reused and 0 measured" in second
    assert saved["machine"]["aten"] == torch.backends.cpu.get_cpu_capability()

    saved["forms"] = {name.replace("+w8a8_intmm", ""): section}         # chosen among fewer forms: measured again
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


@pytest.mark.parametrize("text", ['{"architectures": ["Qwen3MoeForCausalLM"]}', "# notes\n", "[1, 2]"])
def test_a_file_that_is_not_a_forms_file_is_never_overwritten(tmp_path, oracles, text):
    """`--cpu-forms config.json` by mistake: it was taken as a corrupt forms file and overwritten."""
    from colibri_common.errors import ConfigError
    from colibri_common.forms_file import resolve

    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match="is not a CPU forms file, and measuring would overwrite it"):
        resolve(str(path))
    assert path.read_text() == text
    for command in ("tune", "validate"):
        out = colibri_run([command, "--model", str(oracles["qwen3_moe"].path), "--cpu-forms", str(path)], timeout=120)
        assert out.returncode == 2 and "is not a CPU forms file" in out.stderr and "Traceback" not in out.stderr
    assert path.read_text() == text
    with pytest.raises(ConfigError, match="a directory; give a file's path"):
        resolve(str(tmp_path))


def test_tune_says_it_cannot_keep_the_forms_before_it_measures(tmp_path, oracles):
    """`colibri tune --cpu-forms` where nothing can be written measured for seconds (minutes on a large model)
    and only then said that the forms could not be kept."""
    import time

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    t0 = time.perf_counter()
    out = colibri_run(["tune", "--model", str(oracles["qwen3_moe"].path), "--cpu-forms", str(blocker / "f.json")],
                      timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out
    assert out.stderr.strip().splitlines() == [f"error: cannot write {blocker / 'f.json'} ({blocker} is a file, "
                                               f"not a folder); give --cpu-forms a writable path"], out
    assert "measured" not in out.stdout and blocker.read_text() == "not a folder"
    print(f"refused in {time.perf_counter() - t0:.1f} s")


def test_tune_on_a_read_only_folder_takes_a_complete_file_and_refuses_a_new_one(tmp_path, oracles):
    """A forms file measured once and shipped read-only (a ConfigMap, a read-only mount): tune finds nothing new to
    measure and exits 0. Where no file is there yet, the folder's refusal is said before any measuring (the lock
    file left from an earlier run does not make the folder writable). As root, the test drops the capabilities that
    let root write anywhere (setpriv)."""
    import os
    import shutil
    import subprocess

    from tests.conftest import COLIBRI

    model = str(oracles["qwen3_moe"].path)
    forms = tmp_path / "ro" / "forms.json"
    first = colibri_run(["tune", "--model", model, "--cpu-forms", str(forms)], timeout=300)
    assert first.returncode == 0 and "measured" in first.stdout, first
    (tmp_path / "ro" / "new.lock").touch()
    other = json.loads(forms.read_text())
    other["machine"] = {**other["machine"], "cpu": "another CPU"}                 # shipped from another machine
    (tmp_path / "ro" / "other.json").write_text(json.dumps(other))
    prefix = []
    if os.getuid() == 0:
        prefix = ["setpriv", "--bounding-set=-dac_override"]
        if shutil.which("setpriv") is None or subprocess.run([*prefix, "true"]).returncode != 0:
            pytest.skip("root writes anywhere here: no setpriv to drop the capability that lets it")
    try:
        (tmp_path / "ro").chmod(0o555)
        if subprocess.run([*prefix, "touch", str(tmp_path / "ro" / "x")], capture_output=True).returncode == 0:
            pytest.skip("this process writes into a read-only folder (root without setpriv's effect)")
        again = subprocess.run([*prefix, COLIBRI, "tune", "--model", model, "--cpu-forms", str(forms)],
                               capture_output=True, text=True, timeout=300)
        assert again.returncode == 0 and "Traceback" not in again.stderr, again
        assert again.stdout.count("nothing new to measure") == 2, again
        for name in ("new.json", "other.json"):                  # nothing there yet; another machine's forms
            new = tmp_path / "ro" / name
            refused = subprocess.run([*prefix, COLIBRI, "tune", "--model", model, "--cpu-forms", str(new)],
                                     capture_output=True, text=True, timeout=300)
            assert refused.returncode == 1 and refused.stdout == "", refused
            assert refused.stderr.startswith(f"error: cannot write {new} ([Errno 13] Permission denied"), refused
            assert len(refused.stderr.splitlines()) == 1, refused      # no measuring's warnings before it
    finally:
        (tmp_path / "ro").chmod(0o755)


def test_entries_that_make_no_sense_are_measured_again(forms_state):
    table = {cpu_forms.key(48, 32, "int8-float32", 1): "linear", "garbage": "mv",   # a float form for int8
             "reject:nonsense": "?", "reject:1x:float32:mv": "?", cpu_tune.reject_key(8, 8, "float32", "mv"): "kept"}
    measured = cpu_tune.tune([(48, 32, "int8-float32")], table, save=lambda: None, max_rows=1)
    assert measured == [cpu_forms.key(48, 32, "int8-float32", 1)] and "garbage" not in table
    assert "reject:nonsense" not in table and "reject:1x:float32:mv" not in table     # a hand-edited file
    assert table[cpu_tune.reject_key(8, 8, "float32", "mv")] == "kept"
    assert table[measured[0]] in cpu_forms.candidates("int8-float32", 1, 48, 32)


def test_the_moe_form_is_raced_per_row_bucket_and_kept_with_the_linear_forms(torch_forms):
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
    # the worker's MoE form is raced only where the native expert FFN does not serve (it is never raced)
    assert any(k.startswith("moe:") for forms in sections.values() for k in forms) != native.available()
    blocked = tmp_path / "a-file"
    blocked.write_text("")                       # a file where the forms' directory would be: nothing can be written
    out = colibri_run(["tune", "--model", str(oracles["qwen3_moe"].path), "--workers", "2", "--cpu-forms",
                       str(blocked / "forms.json"), "--max-rows", "2"])
    assert out.returncode == 1 and f"error: cannot write {blocked / 'forms.json'}" in out.stderr, out.stderr


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
    assert all("CPU linear forms (experts)" in line for line in lines)   # one section for every worker
    counts = sorted(tuple(map(int, re.search(r"(\d+) reused and (\d+) measured", line).groups())) for line in lines)
    (reused0, measured0), (reused1, measured1) = counts                 # (reused, measured), fewest reused first
    assert reused0 == 0 and measured0 > 0, lines                         # the first measured everything
    assert (reused1, measured1) == (measured0, 0), lines                 # the second reused all of it


def test_where_every_form_is_wrong_the_weight_is_computed_in_float64_and_the_log_says_so(torch_forms, caplog):
    """Correct before fast, and still serving: no candidate right at a row count means the float64 product,
    with an error in the log (a service starts; it is slow there, and says why)."""
    for name in ("mv", "gemv_t", "linear"):
        spec = cpu_forms.FORMS[name]
        cpu_forms.FORMS[name] = cpu_forms.FormSpec(_garbage, "float", max_rows=spec.max_rows)
    table: dict[str, str] = {}
    with caplog.at_level(logging.ERROR, logger="colibri.kernels"):
        cpu_tune.tune([(24, 40, "float32")], table, save=lambda: None, max_rows=8)
    assert {table[cpu_forms.key(24, 40, "float32", b)] for b in (1, 2, 4, 8)} == {cpu_forms.LAST_RESORT}
    assert any("computed in float64" in r.getMessage() for r in caplog.records)
    for rows in (1, 3, 8, 70):
        x, w = torch.randn(rows, 40), torch.randn(24, 40)
        assert wrong(linear(x, w), x, w) is None
    cpu_forms.set_batch_invariant(True)
    x = torch.randn(3, 40)
    assert wrong(linear(x, w), x, w) is None



def test_the_forms_in_force_are_what_pick_rows_runs(forms_state):
    """The start-up log's line of the forms in force: the installed winner where there is one, the default where
    not, the invariant form at every row count under batch invariance; each the form pick_rows runs."""
    cpu_forms.install({cpu_forms.key(48, 32, "float32", 2): "linear"})
    line = cpu_forms.in_force([(48, 32, "float32"), (48, 32, "float32")], max_rows=4)
    w = torch.empty(48, 32)
    want = {b: cpu_forms.form_name(b, "float32", 48, 32) for b in (1, 2, 4)}
    assert line == "48x32:float32 " + " ".join(f"{b}:{form}" for b, form in want.items())
    assert want[2] == "linear" and want[1] == cpu_forms.default_form("float32", 1, 48, 32)
    assert all(cpu_forms.pick_rows(b, torch.float32, w) is cpu_forms.FORMS[want[b]].fn for b in want)
    cpu_forms.set_batch_invariant(True)
    assert set(cpu_forms.in_force([(48, 32, "float32")], 4).split()[1:]) == \
        {f"{b}:{cpu_forms.invariant_form('float32', 48, 32)}" for b in (1, 2, 4)}
