"""OMP_WAIT_POLICY=PASSIVE for the process, set before torch loads libgomp (imported first by `kernels`).

torch's OpenMP threads sleep between regions: the native ops' pool (kernels/native/pool.h) spins instead, and
libgomp's spinning threads (up to ~300000 pauses after each region while it manages no more threads than there are
cores) would hold the core that pool's worker needs. libgomp reads this once, when torch loads it (an
OMP_WAIT_POLICY the user set wins). A program that imported torch before us keeps libgomp's spinning: the kernels
then read memory at about half speed at 5-8 rows an expert (docs/performance.md). `SPINNING` says so, and the
in-process LLM warns.
"""

from __future__ import annotations

import os
import sys

SPINNING = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
