"""`make setup` builds the native CPU kernels (kernels/native/) with the machine's g++: one translation unit per
ISA level, each with its own compiler flags and no torch headers, and the torch ops over them. Where no
compiler is found, or the build fails, it says so and the torch forms run (never an error: a CPU without a
toolchain still serves). A build is reused while its sources, flags, compiler and torch are the same.

    python -m kernels.native_build [--force]
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent / "native"
OUT = HERE / "_build"
LIBRARY = OUT / "colibri_native.so"
STD = ["-std=gnu++20", "-O3", "-fPIC", "-fno-math-errno"]
# compiled with torch's headers (the isa_*.cpp without): OpenMP for at::parallel_for; every product rounded
TORCH_UNITS = ("ops.cpp", "moe_op.cpp", "attention_op.cpp", "norm_op.cpp", "rope_op.cpp", "attention_block_op.cpp",
               "decoder_layer_op.cpp", "expert_answer_op.cpp", "combine_op.cpp", "request_op.cpp", "route_op.cpp",
               "pool.cpp", "sigbus_op.cpp", "frame_op.cpp", "door_op.cpp")
TORCH_FLAGS = ["-w", "-fopenmp", "-ffp-contract=off"]
X86_LEVELS = {                  # the levels of kernels/native/ops.cpp and the flags their TUs compile with
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=fast"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx2", "-mfma", "-ffp-contract=fast"],
    "avx512bf16": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mavx2", "-mfma",
                   "-ffp-contract=fast"],
    "amx": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mavx2", "-mfma", "-mamx-tile",
            "-mamx-bf16", "-mamx-int8", "-ffp-contract=fast"],
}


def levels() -> dict[str, list[str]]:
    return X86_LEVELS if platform.machine() in ("x86_64", "AMD64") else {"generic": []}


def compiler() -> str | None:
    """$CXX where it names a program, else g++ or c++ from the PATH."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return shutil.which("g++") or shutil.which("c++")


def _fingerprint(cxx: str) -> str:
    import torch

    h = hashlib.sha256()
    for f in sorted(HERE.glob("*.[ch]*")):
        h.update(f.name.encode() + f.read_bytes())
    h.update(repr((levels(), STD, TORCH_UNITS, TORCH_FLAGS, torch.__version__, sys.version)).encode())
    h.update(subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.encode())
    return h.hexdigest()[:16]


def _discard_stale() -> None:
    """A failed rebuild leaves no library of older sources behind (the torch forms run, as the message says)."""
    LIBRARY.unlink(missing_ok=True)
    (OUT / "fingerprint").unlink(missing_ok=True)


def build(force: bool = False) -> Path | None:
    """The library's path, built now if it is missing or stale; None (said on stderr) where it cannot be."""
    cxx = compiler()
    if cxx is None:
        print(f"native kernels: no C++ compiler found ({os.environ.get('CXX') or 'g++, c++'}); the torch forms will "
              f"run", file=sys.stderr)
        return None
    import torch
    import torch.utils.cpp_extension as ext

    stamp = OUT / "fingerprint"
    want = _fingerprint(cxx)
    if not force and LIBRARY.is_file() and stamp.is_file() and stamp.read_text() == want:
        return LIBRARY
    t0 = time.perf_counter()
    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        objects = []
        jobs = []
        for name, flags in levels().items():            # the ISA levels in parallel: seconds each
            obj = Path(tmp) / f"isa_{name}.o"
            jobs.append(subprocess.Popen([cxx, *STD, *flags, "-c", str(HERE / f"isa_{name}.cpp"), "-o", str(obj)],
                                         stderr=subprocess.PIPE, text=True))
            objects.append(obj)
        abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
        includes = [f"-I{p}" for p in ext.include_paths()]
        torch_side = []                                  # the torch ops over the levels (at::parallel_for)
        for name in TORCH_UNITS:
            obj = Path(tmp) / f"{Path(name).stem}.o"
            jobs.append(subprocess.Popen([cxx, *STD, *TORCH_FLAGS, abi, *includes, "-c", str(HERE / name), "-o",
                                          str(obj)], stderr=subprocess.PIPE, text=True))
            torch_side.append(str(obj))
        failed = [err for job in jobs if (err := job.communicate()[1]) is not None and job.returncode != 0]
        if failed:
            _discard_stale()
            print(f"native kernels: the build failed; the torch forms will run\n{failed[0][-3000:]}", file=sys.stderr)
            return None
        libs = [f"-L{p}" for p in ext.library_paths()] + [f"-Wl,-rpath,{p}" for p in ext.library_paths()]
        tmp_lib = Path(tmp) / LIBRARY.name
        link = subprocess.run([cxx, "-shared", "-fopenmp", "-o", str(tmp_lib), *torch_side, *map(str, objects), *libs,
                               "-lc10", "-ltorch_cpu"], capture_output=True, text=True)   # torch's own libgomp.so.1
        if link.returncode != 0:
            _discard_stale()
            print(f"native kernels: linking failed; the torch forms will run\n{link.stderr[-3000:]}", file=sys.stderr)
            return None
        os.replace(tmp_lib, LIBRARY)
    stamp.write_text(want)
    print(f"native kernels: built {LIBRARY} ({', '.join(levels())}) in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)
    return LIBRARY


if __name__ == "__main__":
    build(force="--force" in sys.argv)
