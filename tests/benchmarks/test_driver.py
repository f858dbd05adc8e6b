"""`python -m benchmarks`: one subcommand per registered benchmark, each declared once, and `--table-of FILE`
printing the table of a recorded results file as the run printed it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.__main__ import build_parser, main
from benchmarks.registry import MODULES, benchmarks

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_every_module_declares_its_benchmarks_once():
    found = benchmarks()
    assert {"memory", "prompt", "pareto", "arch", "cp", "peers", "trl-scale", "verl", "decode", "provenance", "tree",
            "stress", "gpu", "versus", "work", "threads", "compare", "agent-results"} == set(found)
    assert len(MODULES) == len(set(MODULES))
    names = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert list(names) == list(found)


@pytest.mark.parametrize("name, pattern", [("peers", "peers-b1-llama-4k-*.json"), ("decode", "decode-b1-llama-*.json")])
def test_table_of_a_results_file(name, pattern, capsys):
    path = sorted(RESULTS.glob(pattern))[0]
    table = benchmarks()[name].table
    assert table is not None
    assert main([name, "--table-of", str(path)]) == 0
    assert capsys.readouterr().out == table(json.loads(path.read_text())) + "\n"


def _memory_document(exact_peaks: dict[int, float]) -> dict:
    """A B1 results file: standard_batched and exact at each G, peaks in bytes (well above the resolution)."""
    mib = 2**20
    results = []
    for g, exact in exact_peaks.items():
        results.append({"plan": "standard_batched", "group_size": g, "status": "ok", "peak_bytes": 50 * g * mib,
                        "time_s": 1.0})
        results.append({"plan": "exact", "group_size": g, "status": "ok", "peak_bytes": exact * mib, "time_s": 1.0})
    return {"bench": "memory", "results": results}


def test_checks_of_a_results_file_judge_its_claims(tmp_path, capsys):
    """--checks-of prints one verdict per check and exits 1 when one fails: a replay peak that grows with G fails
    `replay_flat_in_g`, a flat one passes; a recorded tree file passes its own checks."""
    checks = benchmarks()["memory"].checks
    assert checks is not None
    flat, growing = tmp_path / "flat.json", tmp_path / "growing.json"
    flat.write_text(json.dumps(_memory_document({2: 40.0, 8: 40.5})))
    growing.write_text(json.dumps(_memory_document({2: 40.0, 8: 60.0})))
    assert main(["memory", "--checks-of", str(flat)]) == 0
    assert capsys.readouterr().out.splitlines() == ["replay_flat_in_g: ok", "replay_below_standard: ok"]
    assert main(["memory", "--checks-of", str(growing)]) == 1
    assert "replay_flat_in_g: FAILED" in capsys.readouterr().out
    tree = RESULTS / "tree-tau-20261202-195015.json"
    assert main(["tree", "--checks-of", str(tree)]) == 0
    assert "exact_flat_in_g: ok" in capsys.readouterr().out
