"""The benchmarks `python -m benchmarks NAME` runs: each module declares its own `Benchmark` value(s) once, and
`benchmarks()` collects them by name from the modules listed in `MODULES` (a plain list, in the order `--help` shows
them)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: its command name, the one-line `help` of the listing, the `description` of its own `--help`,
    `add_arguments` (adds its options to its argparse subparser), `run` (runs it from the parsed options; returns
    the exit status) and, where it has them, `table` (the text table of one of its results files, as a run prints it:
    `python -m benchmarks NAME --table-of FILE`) and `checks` (the claims a results file is measured for, by name,
    each judged by `verdict`; `--checks-of FILE` prints them and exits 1 when one fails)."""

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    table: Callable[[dict[str, Any]], str] | None = None
    checks: Callable[[dict[str, Any]], dict[str, Any]] | None = None


def verdict(check: Any) -> bool | None:
    """A check's verdict: a bool is one; a dict carries it under `ok` or is a dict of verdicts (all must hold); a
    number is reported, not judged (None)."""
    if isinstance(check, bool):
        return check
    if isinstance(check, dict):
        if "ok" in check:
            return check["ok"]
        if check and all(isinstance(v, bool) for v in check.values()):
            return all(check.values())
    return None


def verdict_lines(checks: dict[str, Any]) -> tuple[list[str], bool]:
    """One line per check (`name: ok | FAILED | reported`) and whether none failed."""
    words = {True: "ok", False: "FAILED", None: "reported (no verdict)"}
    lines = [f"{name}: {words[verdict(check)]}" for name, check in checks.items()]
    return lines, all(verdict(check) is not False for check in checks.values())


# Modules of this package that declare benchmarks: each holds `BENCHMARKS`, a tuple of `Benchmark` values.
MODULES = ("memory", "sweeps", "cp", "peers", "trl_scale", "verl_update", "decode", "provenance", "tree", "stress",
           "gpu", "versus", "work", "threads", "compare", "agent_results")


def benchmarks() -> dict[str, Benchmark]:
    """Every benchmark by its command name, in the order of `MODULES`."""
    found: dict[str, Benchmark] = {}
    for module in MODULES:
        for bench in importlib.import_module(f"benchmarks.{module}").BENCHMARKS:
            if bench.name in found:
                raise ValueError(f"benchmark {bench.name!r} declared twice")
            found[bench.name] = bench
    return found
