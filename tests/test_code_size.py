"""No host function in ``symmring/moe/`` longer than 80 lines and no class longer than 400 (issue 34): read from
the sources' syntax trees, so it stays true as the code changes. Triton kernel bodies are exempt: a function
decorated with ``@triton.jit`` (any decorator whose name ends in ``jit``), or handed to a ``*.jit(...)`` call
of its module (the engines wrap their kernels so on first use)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MOE = Path(__file__).resolve().parents[1] / "symmring" / "moe"
#: The limits, in source lines from the ``def``/``class`` line to the last line of the body (docstrings count).
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 80, 400


def _name(node) -> str:
    """``triton.jit`` for ``triton.jit``, ``t.triton.jit`` and so on (attribute chains and names)."""
    if isinstance(node, ast.Call):
        return _name(node.func)
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def kernel_names(tree: ast.AST) -> set:
    """The functions of a module that are Triton kernels: jit-decorated, or the first argument of a ``*.jit``
    call."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                any(_name(d).split(".")[-1] == "jit" for d in node.decorator_list):
            names.add(node.name)
        if isinstance(node, ast.Call) and _name(node.func).split(".")[-1] == "jit" and node.args \
                and isinstance(node.args[0], ast.Name):
            names.add(node.args[0].id)
    return names


def too_long(root: Path = MOE) -> list:
    """``(path:line, kind, name, lines)`` of every function and class past its limit under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        kernels = kernel_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                kind, limit = "class", MAX_CLASS_LINES
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in kernels:
                kind, limit = "function", MAX_FUNCTION_LINES
            else:
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append((f"{path.relative_to(root.parent.parent)}:{node.lineno}", kind, node.name, lines))
    return found


def test_moe_functions_and_classes_stay_short():
    assert too_long() == [], "split these (limits: functions 80 lines, classes 400):\n" + "\n".join(
        f"  {where}: {kind} {name}, {lines} lines" for where, kind, name, lines in too_long())


@pytest.mark.parametrize("source, found", [
    ("def f():\n" + "    x = 1\n" * 80, [("function", "f", 81)]),
    ("class C:\n" + "    x = 1\n" * 400, [("class", "C", 401)]),
    ("@triton.jit\ndef k():\n" + "    x = 1\n" * 90, []),
    ("def k():\n" + "    x = 1\n" * 90 + "kernel = t.triton.jit(k, do_not_specialize=['M'])\n", []),
    ("def f():\n" + "    x = 1\n" * 79, []),
])
def test_the_check_finds_what_it_should(tmp_path, source, found):
    """The check itself: a function of 81 lines and a class of 401 are found; kernels (decorated or wrapped) are
    not; 80 lines pass."""
    package = tmp_path / "pkg" / "moe"
    package.mkdir(parents=True)
    (package / "m.py").write_text(source)
    assert [(kind, name, lines) for _, kind, name, lines in too_long(package)] == found
