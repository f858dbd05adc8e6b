"""The package's layering as folder rules: the engine (one group's gradient) imports nothing from the trainer,
distributed or integrations folders nor from the benchmarks (a package outside the library); models/, planner/,
admission/ and tasks/ none of those either; nothing in the library imports the benchmarks; the top level holds few
modules; modules and functions stay small; and the context-parallel group implements the protocol through which the
engine uses it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import longstraw

PACKAGE = Path(longstraw.__file__).parent
OUTER = ("longstraw.train", "benchmarks", "longstraw.distributed", "longstraw.integrations")
TOP_LEVEL = {"__init__.py", "cli.py", "choices.py", "plan.py", "peak.py"}


def _modules(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module an import statement in `path` names (top level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _offenders(folders: tuple[str, ...], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for folder in folders:
        for path in _modules(folder):
            bad = sorted(n for n in _imports(path) if n.startswith(forbidden)
                         or any(n == f"longstraw.{m}" for m in ("train", "distributed", "integrations")))
            if bad:
                found[str(path.relative_to(PACKAGE))] = bad
    return found


def test_the_engine_imports_nothing_from_train_benchmarks_distributed_or_integrations():
    assert len(_modules("engine")) >= 20 and (PACKAGE / "api" / "group.py").exists()
    assert _offenders(("engine",), OUTER) == {}


def test_the_engine_imports_neither_the_entry_points_nor_the_admission_checks():
    assert _offenders(("engine",), ("longstraw.api", "longstraw.admission")) == {}
    assert _offenders(("models", "planner", "tasks"), ("longstraw.api", "longstraw.admission")) == {}


def test_models_planner_admission_and_tasks_stay_below_the_trainer():
    assert _offenders(("models", "planner", "admission"), OUTER) == {}
    assert _offenders(("tasks",), ("benchmarks", "longstraw.distributed", "longstraw.integrations")) == {}


def test_nothing_in_the_library_imports_the_benchmarks():
    folders = tuple(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    found = {str(path.relative_to(PACKAGE)): sorted(n for n in _imports(path) if n.split(".")[0] == "benchmarks")
             for path in [*PACKAGE.glob("*.py"), *(m for f in folders for m in _modules(f))]}
    assert len(found) > 50 and {k: v for k, v in found.items() if v} == {}


def test_the_top_level_holds_the_cli_and_few_modules():
    assert {p.name for p in PACKAGE.glob("*.py")} == TOP_LEVEL
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == {"api", "engine", "models", "admission", "train", "tasks", "planner", "distributed",
                       "integrations"}


def test_modules_and_functions_stay_small():
    """No module of the library over 500 lines, no function over 80 (its whole span, docstring included)."""
    long_modules, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(PACKAGE))
        if text.count("\n") > 500:
            long_modules.append(name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno is not None:
                if node.end_lineno - node.lineno + 1 > 80:
                    long_functions.append(f"{name}:{node.name}")
    assert not long_modules and not long_functions, (long_modules, long_functions)


def test_the_walk_sees_function_level_imports(tmp_path):
    """The check above would catch an import hidden inside a function."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from longstraw.distributed.context import check_supported\n")
    assert "longstraw.distributed.context" in _imports(module)


def test_context_parallel_implements_the_engine_protocol():
    from longstraw.distributed.context import ContextParallel
    from longstraw.engine.state.sharding import ContextShards

    wanted = [name for name, _ in inspect.getmembers(ContextShards, inspect.isfunction) if not name.startswith("_")]
    assert {"owner", "owns", "reduce_grad", "merge", "broadcast_from", "check_supported"} <= set(wanted)
    for name in wanted:
        protocol = list(inspect.signature(getattr(ContextShards, name)).parameters)
        implemented = list(inspect.signature(getattr(ContextParallel, name)).parameters)
        assert implemented == protocol, name
