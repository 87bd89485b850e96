"""No module of ours imports itself in a circle, directly or through others, counting imports inside functions
too (grimp, which import-linter installs, reads every import statement): the layers' contract in pyproject.toml
orders the packages, and this keeps each package's own modules in an order a reader can follow."""

from __future__ import annotations

import grimp

PACKAGES = ("colibri", "colibri_common", "router_service", "expert_service", "kernels")


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.find_modules_directly_imported_by(w)))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_the_finder_sees_a_circle():
    graph = grimp.ImportGraph()
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.c", "p.d")):
        graph.add_import(importer=a, imported=b)
    assert circles(graph) == [["p.a", "p.b", "p.c"]]


def test_no_module_imports_itself_in_a_circle():
    assert circles(grimp.build_graph(*PACKAGES, cache_dir=None)) == []
