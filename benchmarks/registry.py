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
    the exit status) and, where it has one, `table` (the text table of one of its results files, as a run prints it:
    `python -m benchmarks NAME --table-of FILE`)."""

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    table: Callable[[dict[str, Any]], str] | None = None


# Modules of this package that declare benchmarks: each holds `BENCHMARKS`, a tuple of `Benchmark` values.
MODULES = ("memory", "sweeps", "cp", "peers", "trl_scale", "verl_update", "decode", "provenance", "tree", "stress",
           "gpu")


def benchmarks() -> dict[str, Benchmark]:
    """Every benchmark by its command name, in the order of `MODULES`."""
    found: dict[str, Benchmark] = {}
    for module in MODULES:
        for bench in importlib.import_module(f"benchmarks.{module}").BENCHMARKS:
            if bench.name in found:
                raise ValueError(f"benchmark {bench.name!r} declared twice")
            found[bench.name] = bench
    return found
