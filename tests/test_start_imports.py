"""`colibri serve` imports torch and gRPC with Python's cyclic collector off (colibri_common.heap.importing): each
full collection while torch imports walks about a million objects, 0.13 s of a 1 s start on the 2-core Xeon. A
`sitecustomize` on PYTHONPATH records, in a freshly exec'd `serve`, whether the collector was on when each was first
imported."""

from __future__ import annotations

import os

from tests.conftest import fleet

PROBE = '''
import gc, os, sys


class FirstImport:
    seen = set()

    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "grpc") and name not in self.seen:
            self.seen.add(name)
            with open(os.environ["COLIBRI_TEST_IMPORTS"], "a") as f:
                f.write(f"{name} collector={'on' if gc.isenabled() else 'off'}\\n")
        return None


sys.meta_path.insert(0, FirstImport())
'''


def test_serve_imports_torch_and_grpc_with_the_collector_off(oracles, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(PROBE)
    said = tmp_path / "imports.txt"
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH", "")) if p)
    with fleet(oracles["qwen3_moe"].path, workers=1, exec_=True,
               env={"PYTHONPATH": path, "COLIBRI_TEST_IMPORTS": str(said)}):
        pass
    lines = said.read_text().splitlines()
    assert sorted(lines) == ["grpc collector=off", "torch collector=off"], lines
