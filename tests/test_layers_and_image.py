"""The package layers of docs/architecture.md hold (import-linter), a broken layer fails the check, and the Docker
image carries every package the project installs (no Docker engine here: the Dockerfile is read)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = str(Path(sys.executable).parent / "lint-imports")
PACKAGES = ("colibri", "colibri_common", "router_service", "expert_service", "kernels")


def installed_packages() -> list[str]:
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted({pattern.split(".")[0].rstrip("*") for pattern in include})


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([LINT_IMPORTS, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


@pytest.fixture
def tree(tmp_path) -> Path:
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_contract_names_every_installed_package():
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert sorted(cfg["tool"]["importlinter"]["root_packages"]) == sorted(PACKAGES) == installed_packages()


def test_layers_hold(tree):
    out = lint_imports(tree)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.mark.parametrize("module, bad_import", [
    ("expert_service/shard.py", "import router_service.engine.engine"),        # services never import each other
    ("router_service/engine/engine.py", "import expert_service.shard"),
    ("colibri_common/config.py", "import router_service.engine.scheduler"),    # the leaf library imports no service
    ("colibri_common/wire.py", "import colibri.cli"),
    ("kernels/cpu_moe.py", "import colibri_common.wire"),              # kernels import none of ours
    ("router_service/model/model.py", "import colibri.client"),              # services never import the user tools
])
def test_a_broken_layer_fails_the_check(tree, module, bad_import):
    path = tree / module
    path.write_text(path.read_text() + f"\n{bad_import}  # noqa\n")
    out = lint_imports(tree)
    assert out.returncode != 0
    assert "BROKEN" in out.stdout


def test_the_dockerfile_copies_every_installed_package():
    dockerfile = (REPO / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY\s+(?:--\S+\s+)*(\S+)\s+\./\S+$", dockerfile, flags=re.M))
    for pkg in installed_packages():
        assert pkg in copied, f"the Dockerfile does not COPY {pkg}/, which pyproject.toml installs"
    for needed in ("pyproject.toml", "protos"):
        assert needed in dockerfile


def test_the_dockerfile_compiles_every_proto():
    dockerfile = (REPO / "Dockerfile").read_text()
    for proto in sorted((REPO / "protos").glob("*.proto")):
        assert f"colibri_common/pb/{proto.name}" in dockerfile, f"the image's protoc step misses {proto.name}"
