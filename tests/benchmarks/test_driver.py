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
            "stress", "gpu"} == set(found)
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
