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
# Set where the user set none, and marked as ours (colibri/__init__.py does the same, as it may run first): other
# programs run from this process (llama.cpp in `make bench`, whose OpenMP threads would sleep between its graph's
# ops, at up to 0.6x its speed at one stream) get the environment the user gave us (`users_environment`).
MARK = "COLIBRI_SET_OMP_WAIT_POLICY"     # holds the value Colibri set (colibri/__init__.py writes the same)
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = os.environ[MARK] = "PASSIVE"


def users_environment() -> dict[str, str]:
    """This process's environment less the OMP_WAIT_POLICY that Colibri set: left where the user set one, or set
    another since (the mark holds the value Colibri set, so a changed value is the user's)."""
    env = dict(os.environ)
    if env.pop(MARK, None) == env.get("OMP_WAIT_POLICY"):
        env.pop("OMP_WAIT_POLICY", None)
    return env
