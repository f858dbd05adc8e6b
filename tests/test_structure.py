"""The package's layering: the core (the engine and what it is made of) never imports `distributed/` or `bench/`,
and the context-parallel group implements the protocol through which the core uses it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import longstraw

PACKAGE = Path(longstraw.__file__).parent
# Front ends and the trainer layer, which may use distributed/ or bench/ (the CLI launches them; the trainer and
# the modules it is made of run data-parallel; compare and the bias meter drive the trainer). The core is the
# engine under them: api, attention, segment, checkpointing, loss, log-probs, models, state/, plans/, planner/.
NOT_CORE = {"cli.py", "trainer.py", "compare.py", "bias.py", "checkpoint.py", "optimizer.py", "reporting.py",
            "sampler.py", "stopping.py", "data.py", "rundir.py", "config.py"}
NOT_CORE_DIRS = {"distributed", "bench", "integrations"}


def _core_modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py")
                  if p.relative_to(PACKAGE).parts[0] not in NOT_CORE_DIRS and p.name not in NOT_CORE)


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


def test_the_core_never_imports_distributed_or_bench():
    modules = _core_modules()
    assert len(modules) >= 20 and any(p.name == "api.py" for p in modules)
    offenders = {str(p.relative_to(PACKAGE)): sorted(n for n in _imports(p)
                                                     if n.startswith(("longstraw.distributed", "longstraw.bench")))
                 for p in modules}
    assert not {k: v for k, v in offenders.items() if v}


def test_the_walk_sees_function_level_imports(tmp_path):
    """The check above would catch an import hidden inside a function (how api.py once reached distributed/)."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from longstraw.distributed.context import check_supported\n")
    assert "longstraw.distributed.context" in _imports(module)


def test_context_parallel_implements_the_core_protocol():
    from longstraw.distributed.context import ContextParallel
    from longstraw.state.sharding import ContextShards

    wanted = [name for name, _ in inspect.getmembers(ContextShards, inspect.isfunction) if not name.startswith("_")]
    assert {"owner", "owns", "reduce_grad", "merge", "broadcast_from", "check_supported"} <= set(wanted)
    for name in wanted:
        protocol = list(inspect.signature(getattr(ContextShards, name)).parameters)
        implemented = list(inspect.signature(getattr(ContextParallel, name)).parameters)
        assert implemented == protocol, name
