"""`python -m benchmarks versus`: one benchmark run alternately from a baseline source tree and from this one, on the
same host in one run, each row's peak and step time side by side.

A change that must not move the numbers (a refactor) is measured this way: each round runs the baseline's bench and
this tree's, the order swapped every other round so that a drift of the host's load falls on both sides; rows are
matched by their keys, and the table prints each side's median over the rounds and the ratio this / baseline.

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

from benchmarks.common import default_out, write_results
from benchmarks.machine import machine_info
from benchmarks.registry import Benchmark
from longstraw.planner import positive_int

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"memory": ("plan", "group_size", "checkpoint"), "tree": ("row", "tasks", "group_size")}
METRICS = ("peak_bytes", "time_s")


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


def rows_by_key(document: dict[str, Any], keys: tuple[str, ...]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {tuple(r.get(k) for k in keys): r for r in document["results"] if r.get("status") == "ok"}


def compare(rounds: list[dict[str, dict[str, Any]]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per row key, each side's median of every metric over the rounds and the ratio this / baseline."""
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
        rows.append(row)
    return rows


def _num(value: float | None, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{fmt}}".rjust(width)


def table(document: dict[str, Any]) -> str:
    """One line per matched row: each side's median peak (MiB) and step time (s), and the ratios this / baseline."""
    keys = KEYS[document["config"]["bench"]]
    lines = [f"{' '.join(f'{k:>16}' for k in keys)} | {'peak MiB base':>13} {'this':>9} {'ratio':>6} | "
             f"{'time s base':>11} {'this':>8} {'ratio':>6}"]
    for r in document["results"]:
        peak, step = r["peak_bytes"], r["time_s"]
        lines.append(f"{' '.join(f'{str(r[k]):>16}' for k in keys)} | {peak['baseline'] / 2**20:13.1f} "
                     f"{peak['this'] / 2**20:9.1f} {_num(r['peak_bytes_ratio'], '.3f', 6)} | "
                     f"{step['baseline']:11.2f} {step['this']:8.2f} {_num(r['time_s_ratio'], '.3f', 6)}")
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
    document: dict[str, Any] = {"bench": "versus", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                "config": {"bench": args.bench, "baseline": str(baseline), "this": str(ROOT),
                                           "rounds": args.rounds, "bench_args": bench_args},
                                "machine": machine_info("cpu")}
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = ("baseline", "this") if i % 2 == 0 else ("this", "baseline")
            done: dict[str, dict[str, Any]] = {}
            for side in order:
                print(f"round {i + 1}/{args.rounds}: {side}", flush=True)
                done[side] = run_side(baseline if side == "baseline" else ROOT, args.bench, bench_args,
                                      Path(tmp) / f"{side}-{i}.json")
            rounds.append(done)
    document["rounds"] = [{side: r[side]["machine"].get("load_average") for side in r} for r in rounds]
    # every round's two result documents as the bench wrote them (their own ratios, floors and checks)
    document["documents"] = rounds
    document["results"] = compare(rounds, KEYS[args.bench])
    document["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(table(document))
    out = args.out or default_out(f"versus-{args.bench}", "--smoke" in bench_args)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    return 0 if write_results(out, document, "versus") is not None else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", required=True, metavar="DIR",
                        help="the source tree of the commit to compare against (git worktree add DIR COMMIT)")
    parser.add_argument("--bench", choices=tuple(KEYS), default="memory", help="the benchmark both sides run")
    parser.add_argument("--rounds", type=positive_int, default=2, help="runs per side, interleaved (default 2)")
    parser.add_argument("--out", help="result JSON (default bench/results/versus-<bench>-<YYYYmmdd-HHMMSS>.json)")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then the bench's own options")


BENCHMARKS = (Benchmark("versus", "a benchmark from a baseline source tree and from this one, interleaved: each "
                        "row's peak and time side by side",
                        "Runs BENCH alternately from --baseline and from this tree, --rounds times each, and "
                        "prints each row's median peak and time per side and their ratio.",
                        add_arguments, run, table),)
