"""The `kernels` package has one API, its `__init__.py`: the services, the user tools and the benchmarks import
from it and from nothing deeper (tests may reach inside, to test the parts)."""

from __future__ import annotations

import ast
from pathlib import Path

import kernels

ROOT = Path(__file__).resolve().parent.parent
USERS = ("colibri", "colibri_common", "router_service", "expert_service", "benchmarks")


def deep_imports(source: str) -> list[str]:
    """`kernels.<something>` modules that `source` imports directly (at any depth of the code)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kernels."):
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("kernels.")]
    return found


def test_the_check_sees_a_deep_import():
    code = "import torch\nfrom kernels import linear\ndef f():\n    from kernels.cpu_forms import FORMS\n"
    assert deep_imports(code) == ["kernels.cpu_forms"]
    assert deep_imports("import kernels.native as n\nfrom kernels import native\n") == ["kernels.native"]


def test_nothing_outside_kernels_imports_below_its_api():
    offenders = {str(p.relative_to(ROOT)): deep for pkg in USERS for p in sorted((ROOT / pkg).rglob("*.py"))
                 if (deep := deep_imports(p.read_text()))}
    assert not offenders, f"import these from `kernels` (add them to kernels/__init__.py): {offenders}"


def test_every_exported_name_exists():
    missing = [name for name in kernels.__all__ if not hasattr(kernels, name)]
    assert not missing and len(set(kernels.__all__)) == len(kernels.__all__)
