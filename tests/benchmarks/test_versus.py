"""`python -m benchmarks versus`: rows of the two sides matched by their keys, each side's median over the rounds and
the ratio this / baseline; the command line of a baseline tree with the benchmarks inside the library."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import versus
from benchmarks.versus import compare, row_args, side_command, table


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


def test_paired_ratio_is_the_median_of_each_rounds_own_ratio():
    # the host ran slow in round 2 on both sides: the ratio of medians sees 1.5, each round's pair sees 1.0
    rounds = [{"baseline": _doc([("exact", 2, 100.0, 1.0)]), "this": _doc([("exact", 2, 100.0, 1.0)])},
              {"baseline": _doc([("exact", 2, 100.0, 1.0)]), "this": _doc([("exact", 2, 100.0, 3.0)])},
              {"baseline": _doc([("exact", 2, 100.0, 3.0)]), "this": _doc([("exact", 2, 100.0, 3.0)])}]
    (row,) = compare(rounds, ("plan", "group_size", "checkpoint"))
    assert row["time_s_ratio"] == 3.0 and row["time_s_paired_ratio"] == 1.0
    assert "paired" in table({"config": {"bench": "memory"}, "results": [row]})


def test_row_args_narrow_each_bench_to_one_row_of_its_grid():
    memory = row_args("memory", ["--plans", "standard", "exact", "--groups", "2", "8", "--warm-steps", "2"])
    assert memory == [["--plans", "standard", "--groups", "2"], ["--plans", "exact", "--groups", "2"],
                      ["--plans", "standard", "--groups", "8"], ["--plans", "exact", "--groups", "8"]]
    tree = row_args("tree", ["--rows", "flattened", "tree_exact", "--tasks", "1", "2", "4", "--groups", "2", "4", "8"])
    # the cross grid: every K at the middle G (4), then the other G at the middle K (2)
    cells = [(c[1], c[3], c[5]) for c in tree]
    assert cells == [(r, k, "4") for k in ("1", "2", "4") for r in ("flattened", "tree_exact")] + \
        [(r, "2", g) for g in ("2", "8") for r in ("flattened", "tree_exact")]
    assert all(c[-2:] == ["--grid", "full"] for c in tree)


def test_row_args_refuse_a_bad_bench_option_before_any_run():
    with pytest.raises(SystemExit):
        row_args("memory", ["--plans", "nonesuch"])


def test_a_row_interleaved_round_runs_each_rows_sides_back_to_back(monkeypatch, tmp_path):
    calls = []

    def fake_side(tree, bench, args, out):
        calls.append((tree, args[-1]))
        side = "this" if tree == versus.ROOT else "baseline"
        return {"machine": {"load_average": [0.5]},
                "results": [{"plan": "exact", "group_size": int(args[-1]), "checkpoint": "none", "status": "ok",
                             "peak_bytes": 1.0, "time_s": 2.0 if side == "this" else 1.0}]}

    monkeypatch.setattr(versus, "run_side", fake_side)
    cells = [["--plans", "exact", "--groups", "2"], ["--plans", "exact", "--groups", "4"]]
    base = tmp_path / "old"
    first = versus.run_round(base, "memory", ["--warm-steps", "2"], cells, 0, tmp_path)
    second = versus.run_round(base, "memory", ["--warm-steps", "2"], cells, 1, tmp_path)
    assert calls == [(base, "2"), (versus.ROOT, "2"), (base, "4"), (versus.ROOT, "4"),
                     (versus.ROOT, "2"), (base, "2"), (versus.ROOT, "4"), (base, "4")]
    assert [r["group_size"] for r in first["this"]["results"]] == [2, 4] and first["this"]["loads"] == [[0.5]] * 2
    rows = compare([first, second], ("plan", "group_size", "checkpoint"))
    assert [r["time_s_paired_ratio"] for r in rows] == [2.0, 2.0]
