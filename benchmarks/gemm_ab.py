"""Two builds of the native linear (`kernels/native/gemm.h`) side by side: the one at a git revision (A) against
the working tree's (B), compiled with the flags of one ISA level into a small C++ driver
(`benchmarks/gemm_ab.cpp`) that times both on the same weights in memory, alternating, several rounds, and says
whether the two wrote the same bits. On this VM a build's speed moves more between runs minutes apart than most
kernel changes do, so a change is judged by such alternating rounds, never by two separate runs.

    python -m benchmarks.gemm_ab [--base HEAD] [--modes layer,linear] [--kinds bf16,int8,int8b,w8a8] [--rows 1,8]
                                 [--threads 2] [--rounds 5] [--level avx2]

`--kinds bf16dp` (levels with AVX512-BF16: avx512bf16, amx) times `kernels/native/dpbf16.h` instead, bf16 rows
against bf16 weights on VDPBF16PS as the dense linears and the experts' gate/up run them there (a layer's down keeps
the float path, as in `moe_`); both revisions need the file.

`--x16-tiles` (level amx) builds B as the amx level builds its weight-only int8 against bf16 x (`int8b`): the
working tree's `amx_x16.h` (AMX int8 tiles from two rows, the int16 form's per-block totals on vectors at one row)
beside A's int16 form on vectors alone (gemm.h without CK_X16_TILES, as the other AVX-512 levels run it). With
`--x16-tiles-base` too, A is built the same way from the base revision's tiles (a change to the tiles against the
tiles before it).

- layer: a MoE layer of the bench shapes (8 of 64 experts, H 1024, I 512; fresh experts every call over 3
  layers), whole experts per thread as `moe_` runs them at few rows per expert, every expert `ROWS` rows;
- linear: lm_head [32000, 1024], its rows split over the threads, the calls cycling through copies of it.

Weights on 2 MiB pages (as in-place experts over a page cache of 2 MiB folios), read from memory at every call.
Needs g++ (or $CXX) and git; prints a table and writes benchmarks/results/gemm_ab.md.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

from benchmarks.common import finish, machine, publish, table
from kernels import native_build

ROOT = Path(__file__).resolve().parent.parent
GEMM = "kernels/native/gemm.h"
DPBF16 = "kernels/native/dpbf16.h"             # the avx512bf16 level's bf16 products (its `linear_bf16`)
X16_TILES = ("kernels/native/amx.h", "kernels/native/amx_x16.h")   # the amx level's int8 tiles (--x16-tiles)
AMX_ENTRIES = ("colibri_linear_bf16_amx", "colibri_linear_i8_tiles_amx", "colibri_linear_i8w_bf16_amx")  # amx.h's
#                                                      extern "C" names, one build's apart where both take the tiles
DRIVER = Path(__file__).resolve().parent / "gemm_ab.cpp"
MODES = ("layer", "linear")
KINDS = ("bf16", "int8", "int8b", "w8a8", "bf16dp")   # int8b: weight-only int8 against rows that were bf16
#                                                     (wdtype 3); bf16dp: bf16 rows on VDPBF16PS (dpbf16.h)


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        raise SystemExit("gemm_ab: git is not installed (build A is read from a git revision)") from None


def source_at(base: str, path: str = GEMM) -> str:
    """A kernel source (gemm.h unless told) as it is at git revision `base`."""
    try:
        return git("show", f"{base}:{path}")
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"gemm_ab: cannot read {path} at {base!r}: {exc.stderr.strip()}") from None


def working_tree() -> str:
    """What build B is, for the results file: the commit, and which of its kernel sources differ from it."""
    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        dirty = git("status", "--porcelain", "--", GEMM, DPBF16, *X16_TILES).split("\n")
    except subprocess.CalledProcessError:
        return "the working tree (not a git checkout)"
    changed = [line[3:] for line in dirty if line.strip()]
    return f"the working tree at {head}" + (f" with {', '.join(changed)} changed" if changed else "")


def lanes(level: str) -> int:
    """The float lanes (CK_WIDTH) that `level`'s own unit, kernels/native/isa_LEVEL.cpp, compiles gemm.h with."""
    unit = (ROOT / "kernels" / "native" / f"isa_{level}.cpp").read_text()
    found = re.search(r"^#define CK_WIDTH (\d+)$", unit, re.M)
    if not found:
        raise SystemExit(f"gemm_ab: kernels/native/isa_{level}.cpp defines no CK_WIDTH")
    return int(found.group(1))


def build(a: str, b: str, level: str, cxx: str, work: Path, dp: tuple[str, str] | None = None,
          tiles: bool = False, base_tiles: str | None = None) -> Path:
    """The driver linked against two texts of gemm.h (A and B), both compiled with `level`'s flags and lanes; with
    `dp`, two texts of dpbf16.h too (after gemm.h, as isa_avx512bf16.cpp includes it), for the bf16dp kind; with
    `tiles`, B takes the working tree's AMX int8 tiles for wdtype 3 (X16_TILES, as isa_amx.cpp includes them), and
    with `base_tiles` (a git revision) A those of that revision."""
    flags = ["-std=gnu++20", "-O3", "-fno-math-errno", *native_build.levels()[level]]
    if dp is not None and "-mavx512bf16" not in flags:
        raise SystemExit(f"gemm_ab: bf16dp needs a level with AVX512-BF16 (avx512bf16, amx), not {level}")
    if tiles and "-mamx-int8" not in flags:
        raise SystemExit(f"gemm_ab: --x16-tiles needs the amx level, not {level}")
    objects, jobs = [], []
    for i, (name, text) in enumerate((("a", a), ("b", b))):   # the two compiled at once
        (work / name).mkdir(parents=True)
        (work / name / "gemm.h").write_text(text)
        if dp is not None:
            (work / name / "dpbf16.h").write_text(dp[i])
        on_tiles = tiles and (name == "b" or base_tiles is not None)
        for path in X16_TILES if on_tiles else ():
            text_of = (ROOT / path).read_text() if name == "b" else source_at(str(base_tiles), path)
            (work / name / Path(path).name).write_text(text_of)
        unit = work / name / "unit.cpp"
        rename = "".join(f"#define {sym} {sym}_{name}\n" for sym in AMX_ENTRIES) if on_tiles else ""
        unit.write_text(f'#define CK_WIDTH {lanes(level)}\n'
                        f'#define CK_NAME {name.upper()}\n' + rename
                        + ('#define CK_X16_TILES 1\n' if on_tiles else "") + '#include "gemm.h"\n'
                        + ('#include "dpbf16.h"\n' if dp is not None else "")
                        + ('#include "amx.h"\n#include "amx_x16.h"\n' if on_tiles else ""))
        obj = work / f"{name}.o"
        jobs.append(subprocess.Popen([cxx, *flags, "-c", str(unit), "-o", str(obj)]))
        objects.append(str(obj))
    if [job.wait() for job in jobs] != [0, 0]:
        raise SystemExit("gemm_ab: a build of gemm.h did not compile (the compiler's message is above)")
    exe = work / "gemm_ab"
    if subprocess.run([cxx, "-std=gnu++20", "-O2", "-fopenmp", str(DRIVER), *objects, "-o", str(exe)]).returncode:
        raise SystemExit("gemm_ab: the driver did not link against the two builds (the compiler's message is above; "
                         "a revision older than the W8A8 entry point, colibri_linear_i8_*, cannot be build A)")
    return exe


def run(exe: Path, mode: str, kind: str, rows: int, threads: int, rounds: int) -> dict[str, object]:
    done = subprocess.run([str(exe), mode, kind, str(rows), str(threads), str(rounds)], stdout=subprocess.PIPE,
                          text=True)
    if done.returncode:
        raise SystemExit(f"gemm_ab: the driver failed on {mode} {kind} at {rows} rows (exit {done.returncode}; its "
                         "message, if any, is above)")
    out = done.stdout.split("\n")
    got: dict[str, object] = {}
    for line in out:
        parts = line.split()
        if parts and parts[0] in ("A", "B"):
            got[parts[0]] = tuple(float(p) for p in parts[1:])           # best ms, mean ms, GB/s at best
        elif parts and parts[0] == "same_bits":
            got["same"] = parts[1] == "1"
        elif parts and parts[0] == "huge_kb":
            got["huge_mib"] = int(parts[1]) / 1024 if int(parts[1]) >= 0 else None
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD", help="the git revision of build A (default: %(default)s)")
    ap.add_argument("--modes", default=",".join(MODES), help="layer, linear (default: %(default)s)")
    ap.add_argument("--kinds", default=",".join(KINDS[:4]),
                    help="bf16, int8, int8b, w8a8, bf16dp (AVX512-BF16 levels) (default: %(default)s)")
    ap.add_argument("--rows", default="1,8", help="rows of x (each expert's, in a layer) (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="OpenMP threads (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating A/B rounds (default: %(default)s)")
    ap.add_argument("--level", default="avx2" if "avx2" in native_build.levels() else "generic",
                    help="the ISA level whose flags both builds take (default: %(default)s)")
    ap.add_argument("--x16-tiles", action="store_true",
                    help="level amx: B with the AMX int8 tiles for int8b (amx_x16.h), A with the vector int16 form")
    ap.add_argument("--x16-tiles-base", action="store_true",
                    help="with --x16-tiles: A with the base revision's AMX int8 tiles instead of the vector form")
    args = ap.parse_args()
    if args.x16_tiles_base and not args.x16_tiles:
        raise SystemExit("gemm_ab: --x16-tiles-base compares two builds of the tiles; give --x16-tiles too")
    modes, kinds = args.modes.split(","), args.kinds.split(",")
    bad = [m for m in modes if m not in MODES] + [k for k in kinds if k not in KINDS]
    try:
        row_counts = [int(r) for r in args.rows.split(",")]
    except ValueError:
        row_counts = []
    if not row_counts or not all(1 <= m <= 64 for m in row_counts) or args.threads < 1 or args.rounds < 1:
        raise SystemExit(f"gemm_ab: --rows takes row counts 1-64 separated by commas (got {args.rows!r}); "
                         "--threads and --rounds at least 1")
    if bad or args.level not in native_build.levels():
        raise SystemExit(f"gemm_ab: unknown {', '.join(bad) or 'level ' + args.level}: modes {', '.join(MODES)}; "
                         f"kinds {', '.join(KINDS)}; levels {', '.join(native_build.levels())}")
    cxx = native_build.compiler()
    if cxx is None:
        raise SystemExit("gemm_ab: no C++ compiler (g++, c++ or $CXX) found")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dp = (source_at(args.base, DPBF16), (ROOT / DPBF16).read_text()) if "bf16dp" in kinds else None
        exe = build(source_at(args.base), (ROOT / GEMM).read_text(), args.level, cxx, Path(tmp), dp, args.x16_tiles,
                    args.base if args.x16_tiles_base else None)
        for mode in modes:
            for kind in kinds:
                for m in row_counts:
                    got = run(exe, mode, kind, m, args.threads, args.rounds)
                    a, b = got["A"], got["B"]
                    huge = "?" if got.get("huge_mib") is None else f"{got['huge_mib']:.0f}"
                    rows.append([mode, kind, str(m), f"{a[0]:.3f} / {a[1]:.3f}", f"{b[0]:.3f} / {b[1]:.3f}",
                                 f"{a[0] / b[0]:.2f}x", f"{a[2]:.1f} / {b[2]:.1f}", "yes" if got["same"] else "NO",
                                 huge])
                    print(" | ".join(rows[-1]), flush=True)
    text = "\n".join([
        "# Two builds of the native linear, alternating", "",
        f"Machine: {machine()}; ISA level compiled: {args.level}; {args.threads} thread(s), {args.rounds} rounds.",
        f"Command: `python -m benchmarks.gemm_ab --base {args.base} --modes {args.modes} --kinds {args.kinds} "
        f"--rows {args.rows} --threads {args.threads} --rounds {args.rounds} --level {args.level}"
        + (" --x16-tiles" if args.x16_tiles else "") + (" --x16-tiles-base" if args.x16_tiles_base else "")
        + f"`. A = `{GEMM}` at `{args.base}`" + (" with its AMX int8 tiles" if args.x16_tiles_base else "")
        + f", B = {working_tree()}" + (" with the AMX int8 tiles for int8b (amx_x16.h)" if args.x16_tiles else "")
        + ". ms: best / mean of the rounds; B faster by: A's best over B's; GB/s at the best; 2 MiB pages: the "
        "driver's anonymous memory on them (AnonHugePages), of the weights' "
        "576 MiB (layer, bf16), 288 (layer, int8), 188 or 156 (linear: copies of lm_head over 4x a 32 MiB L3).",
        "", table(["mode", "weights", "rows", "A ms", "B ms", "B faster by", "GB/s A / B", "same bits",
                   "2 MiB pages (MiB)"], rows), ""])
    publish(text, "gemm_ab")
    return 0


if __name__ == "__main__":
    finish(main())
