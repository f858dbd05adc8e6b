"""The floors of `longstraw`: every module sits on a floor (`FLOORS`), imports only from its own floor or lower ones,
and neither the folders nor the modules import each other in a cycle. Every import is counted, including the lazy
ones inside functions and those under `TYPE_CHECKING`, since a lazy import only hides a dependency until it runs."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Bottom -> top: a module of one entry may import only from entries of its floor or below. An entry holds the module
# of that name and every module under it; the package's own `__init__` is the entry `longstraw` alone.
FLOORS: dict[str, int] = {
    "longstraw.choices": 1,
    "longstraw.plan": 1,
    "longstraw.models": 2,
    "longstraw.tasks": 2,
    "longstraw.engine": 3,
    "longstraw.planner": 4,
    "longstraw.peak": 4,
    "longstraw.admission": 5,
    "longstraw.api": 6,
    "longstraw.distributed": 7,
    "longstraw.train": 8,
    "longstraw.integrations": 9,
    "longstraw.cli": 10,
    "longstraw": 10,
}


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


def whole_package_graph() -> dict[str, set[str]]:
    """Every module under src/longstraw (packages by their `__init__`), with the package modules it imports."""
    files = {}
    for path in (SRC / "longstraw").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        files[".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)] = path
    modules = set(files)
    return {module: _imported(path, module if path.name == "__init__.py" else module.rsplit(".", 1)[0], modules)
            - {module} for module, path in files.items()}


def entry(module: str, floors: dict[str, int] = FLOORS) -> str | None:
    """The entry of `floors` that holds `module` (the longest one naming it or a package above it), or None. The
    root package's entry holds its `__init__` alone."""
    if module in floors:
        return module
    names = [name for name in floors if "." in name and module.startswith(name + ".")]
    return max(names, key=len) if names else None


def unplaced(graph: dict[str, set[str]], floors: dict[str, int] = FLOORS) -> list[str]:
    """The modules of `graph` that no entry of `floors` holds."""
    return sorted(module for module in graph if entry(module, floors) is None)


def upward_imports(graph: dict[str, set[str]], floors: dict[str, int] = FLOORS) -> list[str]:
    """Every import of a module on a higher floor, as 'importer (floor) -> imported (floor)'."""
    arrows = []
    for module, imported in sorted(graph.items()):
        here = entry(module, floors)
        for other in sorted(imported):
            there = entry(other, floors)
            if here is not None and there is not None and floors[there] > floors[here]:
                arrows.append(f"{module} ({floors[here]}) -> {other} ({floors[there]})")
    return arrows


def folder_graph(graph: dict[str, set[str]], floors: dict[str, int] = FLOORS) -> dict[str, set[str]]:
    """The imports between the entries of `floors` (each module counted in the entry that holds it)."""
    folders: dict[str, set[str]] = {}
    for module, imported in graph.items():
        here = entry(module, floors) or module
        targets = {entry(other, floors) or other for other in imported} - {here}
        folders.setdefault(here, set()).update(targets)
        for target in targets:
            folders.setdefault(target, set())
    return folders


def missing_modules() -> list[str]:
    """Every `longstraw` module an import statement names that is not in the package, as 'importer -> name' (such an
    import would escape the floor checks, which see only the package's own modules)."""
    graph = whole_package_graph()
    found = []
    for path in (SRC / "longstraw").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        importer = ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            found += [f"{importer} -> {name}" for name in names if name.split(".")[0] == "longstraw"
                      and name not in graph]
    return sorted(found)


def test_every_import_of_the_package_names_one_of_its_modules():
    missing = missing_modules()
    assert not missing, "imports of no module:\n" + "\n".join(missing)


def test_the_walk_finds_the_package_and_its_imports():
    graph = whole_package_graph()
    assert len(graph) > 50 and "longstraw.admission.loading" in graph["longstraw.train.trainer"]


def test_every_module_sits_on_a_floor():
    """A new folder or top-level module must be placed in `FLOORS` before its imports can be checked."""
    missing = unplaced(whole_package_graph())
    assert not missing, "modules on no floor:\n" + "\n".join(missing)


def test_no_module_imports_from_a_higher_floor():
    arrows = upward_imports(whole_package_graph())
    assert not arrows, "imports of a higher floor:\n" + "\n".join(arrows)


def test_no_import_cycle_between_folders():
    cycles = _cycles(folder_graph(whole_package_graph()))
    assert not cycles, "folder cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_no_import_cycle_between_modules():
    cycles = _cycles(whole_package_graph())
    assert not cycles, "module cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in cycles)


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_the_floor_checks_find_an_unplaced_module_and_an_upward_import():
    floors = {"p.low": 1, "p.high": 2, "p": 3}
    graph = {"p.low.a": {"p.high.b"}, "p.high.b": {"p.low.a"}, "p.new.c": set(), "p": {"p.high.b"}}
    assert unplaced(graph, floors) == ["p.new.c"]
    assert upward_imports(graph, floors) == ["p.low.a (1) -> p.high.b (2)"]
    assert entry("p.lower.x", floors) is None  # a prefix of a name is not its package
    assert _cycles(folder_graph(graph, floors)) == [["p.high", "p.low", "p.high"]]


def test_no_import_cycle_among_the_benchmarks():
    """`benchmarks` (outside the library, at the repository's root) has no cycle among its own modules."""
    folder = SRC.parent / "benchmarks"
    files = {f"benchmarks.{p.stem}": p for p in folder.glob("*.py") if p.stem != "__init__"}
    graph = {module: _imported(path, "benchmarks", set(files)) - {module} for module, path in files.items()}
    assert len(graph) > 10 and any(graph.values())  # the walk found the modules and their imports
    assert _cycles(graph) == []
