"""MKL's VML fault on a process's first call (docs/models.md, the near-tie bug's paragraph): `torch.exp` of 8192
float32 values on two threads, in fresh processes, after nothing, after a 16-value exp on one thread, or after an add
that starts the OpenMP team; counts the processes whose first exp erred (more than 1e-6 relative to float64,
rounded) and those whose three later exps did. A tool for the open bug, not a test.

    python -m tests.vml_first_call [--processes 30]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

CHILD = """
import sys, torch
torch.set_num_threads(2)
before = sys.argv[1]
if before == "exp16":
    torch.exp(torch.rand(16))
elif before == "add":
    (torch.rand(1 << 20) + 1).sum()
x = torch.rand(8192) * 4 - 2                                                    # [8192]
got = [torch.exp(x) for _ in range(4)]
ref = torch.exp(x.double())
bad = [bool(((g.double() - ref).abs() / ref.abs()).max() > 1e-6) for g in got]
print(int(bad[0]), int(any(bad[1:])))
"""


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=30, help="fresh processes a case (default: 30)")
    args = ap.parse_args(argv)
    if args.processes < 1:
        ap.error("--processes must be at least 1")
    for before in ("nothing", "exp16", "add"):
        first = later = 0
        for _ in range(args.processes):
            out = subprocess.run([sys.executable, "-c", CHILD, before], capture_output=True, text=True, check=True)
            f, lt = map(int, out.stdout.split())
            first, later = first + f, later + lt
        print(f"after {before}: the first exp erred in {first} of {args.processes} processes, a later one in {later}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
