"""No import cycle among the modules of `longstraw.bench` and of `longstraw.planner`: every import is
counted, including the lazy ones inside functions, since a lazy import only hides a cycle until it runs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _imported(path: Path, package: str, modules: set[str]) -> set[str]:
    """The modules of `modules` that the file at `path` (a module of `package`) imports anywhere."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package (level 1) or above it
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first search meets (each reported from where it closes)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def import_graph(package: str) -> dict[str, set[str]]:
    folder = SRC.joinpath(*package.split("."))
    files = {f"{package}.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    return {module: _imported(path, package, set(files)) - {module} for module, path in files.items()}


@pytest.mark.parametrize("package", ["longstraw.bench", "longstraw.planner"])
def test_no_import_cycle(package):
    graph = import_graph(package)
    assert len(graph) > 3 and any(graph.values())  # the walk found the modules and their imports
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def whole_package_graph() -> dict[str, set[str]]:
    """Every module under src/longstraw (packages by their `__init__`), with the package modules it imports."""
    files = {}
    for path in (SRC / "longstraw").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        files[".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)] = path
    modules = set(files)
    return {module: _imported(path, module if path.name == "__init__.py" else module.rsplit(".", 1)[0], modules)
            - {module} for module, path in files.items()}


def test_no_import_cycle_in_the_whole_package():
    graph = whole_package_graph()
    assert len(graph) > 50 and "longstraw.api.group" in graph["longstraw.train.trainer"]
    assert _cycles(graph) == []
