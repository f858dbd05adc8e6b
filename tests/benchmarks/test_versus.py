"""`python -m benchmarks versus`: rows of the two sides matched by their keys, each side's median over the rounds and
the ratio this / baseline; the command line of a baseline tree with the benchmarks inside the library."""

from __future__ import annotations

from pathlib import Path

from benchmarks.versus import compare, side_command, table


def _doc(rows: list[tuple[str, int, float, float]]) -> dict:
    return {"results": [{"plan": plan, "group_size": g, "checkpoint": "none", "status": "ok", "peak_bytes": peak,
                         "time_s": t} for plan, g, peak, t in rows]}


def test_medians_and_ratios_of_matched_rows():
    rounds = [{"baseline": _doc([("exact", 2, 100.0, 1.0), ("detach", 2, 50.0, 1.0)]),
               "this": _doc([("exact", 2, 103.0, 1.1)])},
              {"baseline": _doc([("exact", 2, 100.0, 3.0), ("detach", 2, 50.0, 1.0)]),
               "this": _doc([("exact", 2, 97.0, 2.9)])},
              {"baseline": _doc([("exact", 2, 120.0, 2.0), ("detach", 2, 50.0, 1.0)]),
               "this": _doc([("exact", 2, 100.0, 2.2)])}]
    (row,) = compare(rounds, ("plan", "group_size", "checkpoint"))  # detach ran on one side only
    assert (row["plan"], row["group_size"]) == ("exact", 2)
    assert row["peak_bytes"] == {"baseline": 100.0, "this": 100.0} and row["peak_bytes_ratio"] == 1.0
    assert row["time_s"] == {"baseline": 2.0, "this": 2.2} and abs(row["time_s_ratio"] - 1.1) < 1e-12
    printed = table({"config": {"bench": "memory"}, "results": [row]})
    assert "1.000" in printed and "1.100" in printed


def test_a_baseline_with_the_benchmarks_in_the_library_runs_them_there(tmp_path):
    (tmp_path / "src" / "longstraw" / "bench").mkdir(parents=True)
    argv, env = side_command(tmp_path, "memory", ["--demo"], Path("out.json"))
    assert argv[1:] == ["-m", "longstraw.cli", "bench", "memory", "--demo", "--out", "out.json"]
    assert env["PYTHONPATH"] == str(tmp_path / "src")
    argv, env = side_command(Path("/repo"), "tree", [], Path("o.json"))
    assert argv[1:4] == ["-m", "benchmarks", "tree"] and env["PYTHONPATH"].startswith("/repo/src")
