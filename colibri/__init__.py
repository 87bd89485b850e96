"""What users run: the `colibri` CLI, the local launcher, the load generator, the Python client, the validator,
and the offline API: `from colibri import LLM, SamplingParams` (colibri/llm.py)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from colibri.llm import LLM, CompletionOutput, RequestOutput, SamplingParams

__version__ = "0.1.0"

# gRPC core's INFO lines are noise to an operator (a worker that forks a kernel probe while a health check is
# in flight gets "Other threads are currently calling into gRPC, skipping fork() handlers"); its errors
# stay. Set before any gRPC import; a GRPC_VERBOSITY the user set wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
# libgomp's threads sleep between torch ops (kernels/omp_policy.py says why), read when torch loads: `from colibri
# import LLM` loads torch before `kernels` would set it. Where torch is loaded already it is too late: left unset,
# so kernels.omp_policy.SPINNING tells and the LLM warns.
if "torch" not in sys.modules and "OMP_WAIT_POLICY" not in os.environ:
    # marked as Colibri's, not the user's: kernels.omp_policy.MARK (not imported here: it would load torch)
    os.environ["OMP_WAIT_POLICY"] = os.environ["COLIBRI_SET_OMP_WAIT_POLICY"] = "PASSIVE"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
_OFFLINE = ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput")


def __getattr__(name: str) -> object:
    """The offline API loads torch and the services: imported on first use, so `colibri --help` stays quick."""
    if name in _OFFLINE:
        from colibri import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'colibri' has no attribute {name!r}")
