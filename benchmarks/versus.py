"""`python -m benchmarks versus`: one benchmark run alternately from a baseline source tree and from this one, on the
same host in one run, each row's peak and step time side by side.

A change that must not move the numbers (a refactor) is measured this way: each round runs the baseline's bench and
this tree's, the order swapped every other round so that a drift of the host's load falls on both sides; rows are
matched by their keys, and the table prints each side's median over the rounds and the ratio this / baseline, and the
median of the rounds' own ratios (paired: the two sides of one round ran closest in time).

`--interleave row` runs every row of the bench on its own, the baseline's and this tree's back to back (order swapped
every other round), instead of the whole bench per side: a B1 bench takes ~8 minutes per side, over which a shared
host's speed drifts by several percent, while one row's two runs lie a minute apart. Each row's run is the bench
itself narrowed to that row (`row_args`), so both sides still measure it their own way.

The baseline is a source tree of an earlier commit (`git worktree add DIR COMMIT`). Its bench runs as
`python -m longstraw.cli bench NAME` when that tree still holds the benchmarks inside the library
(`src/longstraw/bench/`), else as `python -m benchmarks NAME`, with `PYTHONPATH` naming that tree's sources.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import default_out, finish_run
from benchmarks.machine import machine_info
from benchmarks.registry import Benchmark
from longstraw.planner import positive_int

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"memory": ("plan", "group_size", "checkpoint"), "tree": ("row", "tasks", "group_size")}
METRICS = ("peak_bytes", "time_s")
INTERLEAVE = ("bench", "row")


def side_command(tree: Path, bench: str, args: list[str], out: Path) -> tuple[list[str], dict[str, str]]:
    """The command line that runs `bench` from the source tree `tree` into `out`, and its environment."""
    env = dict(os.environ)
    if (tree / "src" / "longstraw" / "bench").is_dir():
        env["PYTHONPATH"] = str(tree / "src")
        argv = [sys.executable, "-m", "longstraw.cli", "bench", bench]
    else:
        env["PYTHONPATH"] = f"{tree / 'src'}{os.pathsep}{tree}"
        argv = [sys.executable, "-m", "benchmarks", bench]
    return [*argv, *args, "--out", str(out)], env


def run_side(tree: Path, bench: str, args: list[str], out: Path) -> dict[str, Any]:
    """One run of `bench` from `tree`: its results document."""
    argv, env = side_command(tree, bench, args, out)
    done = subprocess.run(argv, env=env, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-2000:]}")
    return json.loads(out.read_text())


def row_args(bench: str, bench_args: list[str]) -> list[list[str]]:
    """The bench's rows as option lists, each narrowing `bench_args` to one row (appended after them, so they win):
    memory, one per (plan, G) of its grid (`--plans P --groups G`); tree, one per (row, K, G) it would run (`--rows
    ROW --tasks K --groups G --grid full`). The bench's own parser reads `bench_args` (a bad option fails here, before
    any run)."""
    from benchmarks.registry import benchmarks
    from longstraw.cli import Parser

    parser = Parser(prog=f"versus -- ({bench}'s options)")
    benchmarks()[bench].add_arguments(parser)
    args = parser.parse_args(bench_args)
    args.fail = parser.error
    if bench == "memory":
        from benchmarks.memory import config_from_args as memory_config

        memory = memory_config(args, parser.error)
        return [["--plans", plan, "--groups", str(g)] for g in memory.groups for plan in memory.plans]
    from benchmarks.tree import config_from_args as tree_config
    from benchmarks.tree import pairs

    tree = tree_config(args)
    return [["--rows", row, "--tasks", str(k), "--groups", str(g), "--grid", "full"]
            for k, g in pairs(tree) for row in tree.rows]


def run_round(baseline: Path, bench: str, bench_args: list[str], cells: list[list[str]] | None, index: int,
              tmp: Path) -> dict[str, dict[str, Any]]:
    """Round `index`: each side's results document, the whole bench per side (cells None) or row by row, both sides
    of each row back to back (a side's document then holds all its rows' results, the machine of its first run and
    each run's load average under `loads`). The order of the sides swaps every other round."""
    order = ("baseline", "this") if index % 2 == 0 else ("this", "baseline")
    trees = {"baseline": baseline, "this": ROOT}
    if cells is None:
        done = {}
        for side in order:
            print(f"round {index + 1}: {side}", flush=True)
            done[side] = run_side(trees[side], bench, bench_args, tmp / f"{side}-{index}.json")
        return done
    merged: dict[str, dict[str, Any]] = {side: {"results": [], "loads": []} for side in order}
    for j, cell in enumerate(cells):
        for side in order:
            print(f"round {index + 1}, row {j + 1}/{len(cells)} {' '.join(cell)}: {side}", flush=True)
            doc = run_side(trees[side], bench, [*bench_args, *cell], tmp / f"{side}-{index}-{j}.json")
            merged[side].setdefault("machine", doc.get("machine", {}))
            merged[side]["results"].extend(doc["results"])
            merged[side]["loads"].append(doc.get("machine", {}).get("load_average"))
    return merged


def rows_by_key(document: dict[str, Any], keys: tuple[str, ...]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {tuple(r.get(k) for k in keys): r for r in document["results"] if r.get("status") == "ok"}


def compare(rounds: list[dict[str, dict[str, Any]]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per row key, each side's median of every metric over the rounds, the ratio this / baseline of the medians, and
    `<metric>_paired_ratio`: the median over the rounds of each round's own ratio this / baseline."""
    per_side = {side: [rows_by_key(r[side], keys) for r in rounds] for side in ("baseline", "this")}
    common = set.intersection(*(set(rows) for runs in per_side.values() for rows in runs))
    rows = []
    for key in sorted(common, key=str):
        row: dict[str, Any] = {**dict(zip(keys, key)), "status": "ok"}
        for metric in METRICS:
            medians = {side: statistics.median(float(runs[i][key][metric]) for i in range(len(runs)))
                       for side, runs in per_side.items()}
            row[metric] = medians
            row[f"{metric}_ratio"] = medians["this"] / medians["baseline"] if medians["baseline"] else None
            paired = [float(runs_this[key][metric]) / float(runs_base[key][metric])
                      for runs_this, runs_base in zip(per_side["this"], per_side["baseline"])
                      if float(runs_base[key][metric])]
            row[f"{metric}_paired_ratio"] = statistics.median(paired) if paired else None
        rows.append(row)
    return rows


def _num(value: float | None, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{fmt}}".rjust(width)


def table(document: dict[str, Any]) -> str:
    """One line per matched row: each side's median peak (MiB) and step time (s), the ratios this / baseline of the
    medians, and the time's paired ratio (the median of the rounds' own ratios)."""
    keys = KEYS[document["config"]["bench"]]
    lines = [f"{' '.join(f'{k:>16}' for k in keys)} | {'peak MiB base':>13} {'this':>9} {'ratio':>6} | "
             f"{'time s base':>11} {'this':>8} {'ratio':>6} {'paired':>6}"]
    for r in document["results"]:
        peak, step = r["peak_bytes"], r["time_s"]
        lines.append(f"{' '.join(f'{str(r[k]):>16}' for k in keys)} | {peak['baseline'] / 2**20:13.1f} "
                     f"{peak['this'] / 2**20:9.1f} {_num(r['peak_bytes_ratio'], '.3f', 6)} | "
                     f"{step['baseline']:11.2f} {step['this']:8.2f} {_num(r['time_s_ratio'], '.3f', 6)} "
                     f"{_num(r.get('time_s_paired_ratio'), '.3f', 6)}")
    for i, done in enumerate(document.get("documents", []), 1):  # bench memory's FLOP-floor shares, per round
        for side, doc in done.items():
            shares = (doc.get("ratios") or {}).get("share_of_flop_floor") or {}
            floors = (doc.get("ratios") or {}).get("flop_floor") or {}
            if any(v is not None for v in shares.values()):
                lines.append(f"round {i} {side}: standard / plan time over its FLOP floor: " + ", ".join(
                    f"{plan} {_num(v, '.2f', 0)} of {_num(floors.get(plan), '.2f', 0)}x" for plan, v in shares.items()))
    return "\n".join(lines)


def baseline_tree(path: str) -> Path:
    """--baseline's source tree, resolved; SystemExit saying how to make one when it is not a LongStraw tree."""
    baseline = Path(path).resolve()
    if not (baseline / "src" / "longstraw").is_dir():
        raise SystemExit(f"--baseline {baseline}: not a LongStraw source tree (no src/longstraw); make one with "
                         "`git worktree add DIR COMMIT`")
    return baseline


def run(args: argparse.Namespace) -> int:
    baseline = baseline_tree(args.baseline)
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    cells = row_args(args.bench, bench_args) if args.interleave == "row" else None
    document: dict[str, Any] = {"bench": "versus", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                "config": {"bench": args.bench, "baseline": str(baseline), "this": str(ROOT),
                                           "rounds": args.rounds, "interleave": args.interleave,
                                           "bench_args": bench_args},
                                "machine": machine_info("cpu")}
    with tempfile.TemporaryDirectory() as tmp:
        rounds = [run_round(baseline, args.bench, bench_args, cells, i, Path(tmp)) for i in range(args.rounds)]
    document["rounds"] = [{side: r[side].get("loads") or r[side]["machine"].get("load_average") for side in r}
                          for r in rounds]
    # every round's two result documents as the bench wrote them (their own ratios, floors and checks)
    document["documents"] = rounds
    document["results"] = compare(rounds, KEYS[args.bench])
    return finish_run(document, table, args.out or default_out(f"versus-{args.bench}", "--smoke" in bench_args),
                      "versus")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", required=True, metavar="DIR",
                        help="the source tree of the commit to compare against (git worktree add DIR COMMIT)")
    parser.add_argument("--bench", choices=tuple(KEYS), default="memory", help="the benchmark both sides run")
    parser.add_argument("--rounds", type=positive_int, default=2, help="runs per side, interleaved (default 2)")
    parser.add_argument("--interleave", choices=INTERLEAVE, default="bench",
                        help="bench (default): the whole bench per side each round; row: each row's two sides back "
                             "to back (module docstring)")
    parser.add_argument("--out", help="result JSON (default bench/results/versus-<bench>-<YYYYmmdd-HHMMSS>.json)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the bench's own options")


BENCHMARKS = (Benchmark("versus", "a benchmark from a baseline source tree and from this one, interleaved: each "
                        "row's peak and time side by side",
                        "Runs BENCH alternately from --baseline and from this tree, --rounds times each, and "
                        "prints each row's median peak and time per side and their ratio.",
                        add_arguments, run, table),)
