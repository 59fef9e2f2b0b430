"""symmring's import graph has no cycle.

The graph is read from the sources (the AST, nothing is imported): every ``import symmring...`` and ``from
... import ...`` anywhere in a module (at module level, in a function, under ``try`` or ``if``), absolute or
relative, is an edge from that module to the module it names: ``from .pkg import name`` goes to ``pkg.name``
when that is a module, else to ``pkg`` (its ``__init__``). Imports under ``if TYPE_CHECKING:`` never run and
are left out. A cycle, even through an import inside a function, means two modules that each need the other:
one of them holds a piece that belongs below both. The failure names every cycle, edge by edge, with the file
and line of each import.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]

#: An edge's origin: (file, line) of the import statement.
Where = Tuple[Path, int]


def modules(root: Path, package: str) -> Dict[str, Tuple[Path, bool]]:
    """``{dotted name: (file, is a package)}`` of every module under ``root / package``."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


def _type_checking_only(tree: ast.AST) -> Set[int]:
    """ids of the import nodes inside an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) block."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
            if name == "TYPE_CHECKING":
                skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


def import_graph(root: Path, package: str) -> Dict[str, Dict[str, Where]]:
    """``{module: {imported module: where}}`` over ``package``'s modules (imports of other packages left out)."""
    mods = modules(root, package)

    def existing(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: Dict[str, Dict[str, Where]] = {}
    for name, (path, is_package) in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_only(tree)
        here = name if is_package else name.rpartition(".")[0]
        edges: Dict[str, Where] = {}
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [existing(alias.name) for alias in node.names if alias.name.split(".")[0] == package]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != package:
                    continue
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else existing(base)
                           for alias in node.names]
            for target in targets:
                if target and target != name:
                    edges.setdefault(target, (path, node.lineno))
        graph[name] = edges
    return graph


def cycles(graph: Dict[str, Dict[str, Where]]) -> List[List[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan), each as the
    list of its modules in import order, the first repeated at the end."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return [_cycle_in(graph, set(c), c[0]) for c in components]


def _cycle_in(graph: Dict[str, Dict[str, Where]], component: Set[str], start: str) -> List[str]:
    """A shortest cycle from ``start`` back to itself inside ``component`` (breadth first)."""
    parent: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w in component and w not in parent:
                    parent[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


def describe(graph: Dict[str, Dict[str, Where]], cycle: List[str], root: Path) -> str:
    """``a -> b -> a`` and, per edge, the import's file and line."""
    steps = [f"  {a} -> {b} ({graph[a][b][0].relative_to(root)}:{graph[a][b][1]})" for a, b in zip(cycle, cycle[1:])]
    return " -> ".join(cycle) + "\n" + "\n".join(steps)


def test_symmring_has_no_import_cycle():
    graph = import_graph(ROOT, "symmring")
    assert len(graph) > 50 and "symmring.moe.gpu.stages" in graph  # the sources were found
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(describe(graph, c, ROOT) for c in found)


# The check itself must be able to fail: a package with each kind of cycle.

def _package(tmp_path: Path, files: Dict[str, str]) -> Path:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_finds_cycles_through_function_level_relative_and_absolute_imports(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from . import b\n",                                  # relative, module level
        "b.py": "def f():\n    from .sub.c import thing\n",            # relative, in a function
        "sub/__init__.py": "",
        "sub/c.py": "import pkg.a\nthing = 1\n",                      # absolute
        "d.py": "from .sub import c\n",                               # into the cycle, not part of it
        "e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import f\n",
        "f.py": "try:\n    from .e import x\nexcept ImportError:\n    pass\n",
    })
    graph = import_graph(root, "pkg")
    assert set(graph["pkg.d"]) == {"pkg.sub.c"} and set(graph["pkg.e"]) == set()
    found = cycles(graph)
    assert found == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    text = describe(graph, found[0], root)
    assert "pkg.b -> pkg.sub.c (pkg/b.py:2)" in text


def test_an_import_of_a_name_goes_to_its_package_and_type_checking_imports_do_not_count(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from .x import VALUE\n",
        "x.py": "VALUE = 1\n",
        "y.py": "from . import VALUE\n",   # a name of the package: an edge to pkg (its __init__)
        "z.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .y import w\n",
    })
    graph = import_graph(root, "pkg")
    assert set(graph["pkg.y"]) == {"pkg"} and set(graph["pkg"]) == {"pkg.x"} and not graph["pkg.z"]
    assert cycles(graph) == []
    (root / "pkg" / "x.py").write_text("def f():\n    from . import y\n")
    assert cycles(import_graph(root, "pkg")) == [["pkg", "pkg.x", "pkg.y", "pkg"]]
