"""`python -m benchmarks verl --smoke`: every row runs verl's TrainingWorker update (verl's engine, LongStraw's), the
JSON has each row's peak, and LongStraw's exact row is below verl's micro-batch-G row; the table a real run prints;
the missing-verl error. verl 0.9 pins transformers < 5.11, so the run needs a venv of its own (the verl extra with
constraints-verl.txt) and skips elsewhere."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import verl_update
from benchmarks.__main__ import main
from benchmarks.verl_update import ROWS, SHAPES, format_table

IMPORT_PATH = os.pathsep.join(str(Path(__file__).resolve().parents[2] / d) for d in ("src", "."))


def test_smoke_run_has_every_row_and_exact_below_verls_micro_batch_g(tmp_path, capsys, monkeypatch):
    pytest.importorskip("verl", reason="verl is not installed here: run this in a venv with the verl extra "
                                       "(constraints-verl.txt; verl 0.9 pins transformers < 5.11)")
    # The worker is a fresh interpreter: make it import this checkout's package (a worktree's, too).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (IMPORT_PATH, os.environ.get("PYTHONPATH")) if p))
    out = tmp_path / "verl.json"
    assert main(["verl", "--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "verl" and doc["smoke"] and doc["shape"]["model"] == SHAPES["smoke"].model
    rows = {r["id"]: r for r in doc["results"]}
    assert list(rows) == [row.id for row in ROWS]  # the table's order, whatever order the process ran them in
    for row in ROWS:
        r = rows[row.id]
        assert r["status"] == "ok", r
        assert r["update_peak_bytes"] > 0 and r["absolute_hwm_bytes"] > 0 and r["time_s"] > 0
        assert r["hwm_reset"] and r["sharded"] and r["rows"] == SHAPES["smoke"].group_size
        assert r["engine_class"] == ("LongStrawFSDPEngine" if row.engine == "longstraw" else "FSDPEngineWithLMHead")
        assert (r["prompt_state_bytes"] is None) is (row.engine == "verl")
        assert r["longstraw_plan"] == row.plan
    assert rows["longstraw-exact"]["backward_tree_calls"] == 1  # one mini-batch: one tree
    # LongStraw's rows ran first in the shared smoke process, so reused heap can only have lowered verl's peak.
    assert rows["longstraw-exact"]["update_peak_bytes"] < rows["verl-mbG"]["update_peak_bytes"]
    assert doc["checks"]["longstraw-exact_below_verl-mbG"]
    assert "LongStraw exact: ok" in capsys.readouterr().out
    table = format_table(doc)  # the table a real run prints, from the smoke document
    assert all(row.label in table for row in ROWS) and "ratio" in table and "1.000" in table


def test_the_table_names_a_row_over_the_memory_limit():
    doc = {"shape": {"model": "b1-llama", "dtype": "float32", "prompt_tokens": 8192, "response_tokens": 128,
                     "group_size": 8, "chunk_size": 1024},
           "results": [{"id": "verl-mbG", "label": "verl, micro-batch G (packed)", "status": "over_memory",
                        "error": "stopped: its RSS passed --max-memory 17.9 GiB (18.0 GiB)"},
                       {"id": "longstraw-exact", "label": "LongStraw exact", "status": "ok",
                        "update_peak_bytes": 300 * 2**20, "absolute_hwm_bytes": 900 * 2**20, "time_s": 60.0,
                        "cpu_time_s": 50.0, "cpu_pressure": 0.05, "prompt_state_bytes": 16 * 2**20}],
           "expectations": verl_update.expectations(SHAPES["default"], 32000, 16 * 2**20)}
    table = format_table(doc)
    assert "OVER LIMIT: stopped" in table and "300.0" in table
    # no verl micro-batch G measurement: no ratio; the floor notes give the shape's logits and packed mask
    words = " ".join(table.split())  # the notes are wrapped
    assert "  -  " in table.splitlines()[3] and "are 1015.6 MiB, G of them 8125.0 MiB" in words
    assert "N = G(P+R) = 66560 tokens" in words


def test_without_verl_it_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(verl_update, "missing_verl", lambda: "it needs verl (pip install 'longstraw[verl]')")
    assert main(["verl", "--smoke"]) == 1
    assert "pip install 'longstraw[verl]'" in capsys.readouterr().err
