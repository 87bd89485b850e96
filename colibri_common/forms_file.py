"""The file that keeps the CPU linear forms measured on this machine, so the next start reuses them.

    {"version": 1,
     "machine": {"cpu": "AMD EPYC ...", "isa": ["avx2", "fma", ...], "torch": "2.13.0+cpu", "aten": "AVX2"},
     "forms": {"threads=2 forms=...": {"1024x1024:float32:1": "mv", ...,
                                       "reject:40x72:int8-bfloat16:int8_pack": "crashed (SIGSEGV)"},
               "experts forms=...": {...}}}

The router's forms are kept per torch thread count. The experts' forms are one section for every worker of
the machine whatever its thread count, so a given expert computes a given row alike on every worker: the
fleet's shape (1, 2 or 3 workers, replicas) never changes a token. `reject:` entries are the forms found
wrong or crashing here for a shape, and why (kernels/cpu_tune.py). A file written on another CPU, with other
ISA flags, another torch or another ATen kernel level (`ATEN_CPU_CAPABILITY`) is ignored and rebuilt; a
corrupt one is rebuilt with a warning. Writes are atomic and merge with what another process of the same
fleet wrote meanwhile (an flock around read-modify-write), so a router and its workers can share one file.
Measuring is exclusive too (`FormsFile.measuring`): the workers of a fleet start at once with the same
shapes, so the first measures them and the others reuse its forms instead of racing it on the same cores.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from colibri_common.errors import ConfigError
from kernels import BUCKETS, CANDIDATES, MoeShape, tune

log = logging.getLogger("colibri")

VERSION = 1
ISA_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16", "i8mm")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def cpu_isa() -> list[str]:
    """The ISA flags that decide which GEMM forms are fast (from /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags |= set(line.split(":", 1)[1].split())
    return [f for f in ISA_FLAGS if f in flags]


def machine() -> dict[str, object]:
    return {"cpu": cpu_model(), "isa": cpu_isa(), "torch": torch.__version__,
            "aten": torch.backends.cpu.get_cpu_capability()}


def describe_machine() -> str:
    """One line for logs and results files: the CPU, its ISA flags and the kernel level torch runs."""
    m = machine()
    return f"{m['cpu']} (ISA: {' '.join(m['isa']) or 'none listed'}; torch {m['torch']}, ATen {m['aten']} kernels)"


def default_path() -> Path:
    base = os.environ.get("COLIBRI_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "colibri")
    return Path(base) / "cpu-forms.json"


def resolve(setting: str) -> Path | None:
    """`--cpu-forms`: 'auto' = the default path, 'off' = no file (the built-in defaults), else a path. A path that
    holds something else than a forms file (a checkpoint's config.json given by mistake) is a ConfigError: the
    measurement would overwrite it."""
    if setting == "off":
        return None
    path = default_path() if setting == "auto" else Path(setting)
    if path.is_dir():
        raise ConfigError(f"--cpu-forms {path}: a directory; give a file's path, such as {path / 'cpu-forms.json'} "
                          f"(or 'auto')")
    if path.exists() and not _ours(path):
        raise ConfigError(f"--cpu-forms {path}: this file is not a CPU forms file, and measuring would overwrite it; "
                          f"give a path of its own (or 'auto')")
    return path


def _ours(path: Path) -> bool:
    """Whether `path` is a forms file (any version, or one a crash left unreadable) rather than someone else's."""
    if not path.is_file():
        return False
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        return False
    try:
        raw = json.loads(text)
    except ValueError:                        # empty, or an object that broke: ours, corrupt (measured again)
        return not text.strip() or text.lstrip().startswith("{")
    return isinstance(raw, dict) and "forms" in raw


def _read(path: Path, here: dict[str, object], say: bool = True) -> dict[str, dict[str, str]]:
    """The forms sections of `path` if it was written on this machine; {} otherwise (said in the log)."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
        if raw.get("version") != VERSION or not isinstance(raw.get("forms"), dict):
            raise ValueError("unknown layout")
        sections = {k: {str(a): str(b) for a, b in v.items()} for k, v in raw["forms"].items()}
    except (ValueError, AttributeError, OSError) as exc:
        if say:
            log.warning("%s is corrupt (%s); measuring the CPU forms again", path, exc)
        return {}
    if raw.get("machine") != here:
        if say:
            log.info("%s was measured on %s; this is %s: measuring again", path, raw.get("machine"), here)
        return {}
    return sections


class FormsFile:
    """The measured forms of this machine for this process's thread count, as a dict to fill."""

    def __init__(self, path: Path | None, candidates: str = "", experts: bool = False) -> None:
        """`candidates` names the forms the caller races (a release that adds one measures again); `experts`: the
        experts' section, one for every worker of the machine."""
        self.path = path
        self.unsaved: str | None = None                 # why the last save failed (the forms stay in memory)
        self.machine = machine()
        who = "experts" if experts else f"threads={torch.get_num_threads()}"
        self.section = who + (f" forms={candidates}" if candidates else "")
        self.forms: dict[str, str] = dict(_read(path, self.machine).get(self.section, {})) if path else {}
        self.loaded = sum(not k.startswith("checked:") for k in self.forms)   # forms, not checks passed

    def summary(self, measured: list[str]) -> str:
        rejects = sorted(k.removeprefix("reject:") for k in self.forms if k.startswith("reject:"))
        said = f"; rejected here: {', '.join(rejects)}" if rejects else ""
        who = self.section.split(" forms=")[0]
        if self.path is None:
            return f"CPU forms ({who}): the built-in defaults, checked on this machine (--cpu-forms off){said}"
        return f"CPU linear forms ({who}): {self.loaded} reused and {len(measured)} measured, {self.path}{said}"

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Hold the file's measuring lock (another process of the fleet may be measuring: wait for it), then take
        the forms it measured meanwhile; measure inside. Without a file, or where the lock cannot be had (an
        unwritable directory, a filesystem without flock), measure unlocked."""
        fd = -1
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path.with_suffix(".measure.lock"), os.O_RDONLY | os.O_CREAT, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:             # another service of the fleet is measuring: say so, wait
                    log.info("another process is measuring the CPU forms (%s); waiting to reuse them", self.path)
                    fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                log.warning("cannot lock %s for measuring (%s); measuring beside the other services",
                            self.path, exc)
                if fd >= 0:
                    os.close(fd)
                fd = -1
        try:
            if fd >= 0:
                fresh = _read(self.path, self.machine, say=False).get(self.section, {})  # type: ignore[arg-type]
                self.forms.update({k: v for k, v in fresh.items() if k not in self.forms})
                self.loaded = sum(not k.startswith("checked:") for k in self.forms)   # forms, not checks passed
            yield
        finally:
            if fd >= 0:
                os.close(fd)                            # closing the descriptor releases the lock

    def save(self) -> None:
        """Merge this process's forms into the file, atomically; a file that cannot be written (a full disk, a
        read-only directory) is a warning, and the forms measured stay in use from memory."""
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                sections = _read(self.path, self.machine)
                sections[self.section] = {**sections.get(self.section, {}), **self.forms}
                write_atomic(self.path, json.dumps({"version": VERSION, "machine": self.machine, "forms": sections},
                                                   indent=1, sort_keys=True))
        except OSError as exc:
            self.unsaved = str(exc)
            log.warning("cannot write %s (%s); the measured forms are used but not kept", self.path, exc)
        else:
            self.unsaved = None


def unwritable(path: Path) -> str | None:
    """Why the forms cannot be kept at `path` (None: they can), found as `FormsFile.save` would find it: its folder
    made, its lock file opened and a temp file made beside it (`write_atomic`'s), now; for `colibri tune` to say so
    before it measures rather than after."""
    try:
        above = next((p for p in path.parents if p.exists()), None)
        if above is not None and not above.is_dir():        # mkdir would say "File exists"
            return f"{above} is a file, not a folder"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a"):
            pass
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        return str(exc)
    return None


def measured_here(path: Path) -> bool:
    """Whether `path` holds forms measured on this machine (a file measured on another, or none, is measured
    again in full)."""
    return bool(_read(path, machine(), say=False))


def write_atomic(path: Path, text: str) -> None:
    """`text` as the whole of `path`, atomically: written to a temp file beside it, then renamed over it. A write
    that fails (ENOSPC, EDQUOT, any OSError) removes the temp file before the error goes on, so a full disk
    gathers no half-written or empty files."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def in_force(path: Path | None, candidates: str = "") -> list[str]:
    """What the file holds for this machine, section by section (for `colibri validate`): which forms won how
    often, and every reject with its reason; sections measured among other `candidates` (an older release's)
    are only counted, as the services measure again."""
    if path is None:
        return ["CPU forms: off (the built-in defaults, checked at start)"]
    sections = _read(path, machine(), say=False)
    current = {k: v for k, v in sections.items() if not candidates or k.endswith(f" forms={candidates}")}
    stale = len(sections) - len(current)
    if not current:
        return [f"CPU forms: none measured on this machine yet ({path}; the first start measures them)"
                + (f"; {stale} section(s) of an older set of forms" if stale else "")]
    out = [f"CPU forms: {stale} section(s) of an older set of forms, not used"] if stale else []
    for name, table in sorted(current.items()):
        won: dict[str, int] = {}
        for k, form in table.items():
            if not k.startswith(("reject:", "checked:")):        # a check passed is no form won
                won[form] = won.get(form, 0) + 1
        wins = ", ".join(f"{form} x{n}" for form, n in sorted(won.items(), key=lambda kv: -kv[1]))
        out.append(f"CPU forms {name.split(' forms=')[0]}: {wins or 'none'} ({path})")
        out += [f"  rejected {k.removeprefix('reject:')}: {why}" for k, why in sorted(table.items())
                if k.startswith("reject:")]
    return out


def tune_forms(setting: str, shapes: Iterable[tuple[int, int, str]], *, experts: bool = False,
               moe: Iterable[MoeShape] = (), max_rows: int = BUCKETS[-1]) -> tuple[FormsFile, list[str]]:
    """The one way a router, a worker and `colibri tune` settle their CPU forms: those of the forms file named by
    `setting` (`--cpu-forms`: a path, 'auto' or 'off'), checked, and what it lacks measured now, one process of
    the machine at a time, then installed. `experts`: the workers' section; `moe`: their fused MoE shapes.
    Returns the file and the keys measured now (for `FormsFile.summary`)."""
    forms = FormsFile(resolve(setting), CANDIDATES, experts=experts)
    with forms.measuring():
        measured = tune(shapes, forms.forms, forms.save, max_rows=max_rows, moe=moe, timed=forms.path is not None)
    return forms, measured
