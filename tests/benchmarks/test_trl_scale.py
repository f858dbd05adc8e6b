"""`python -m benchmarks trl-scale --smoke`: every row runs on 2 real gloo processes, the FSDP rows really sharded, the
context-parallel row holding half of each prompt's state; the table, the planner's forecasts and the missing-extra
error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import trl_scale
from benchmarks.__main__ import main
from benchmarks.trl_scale import ROWS, SHAPES, format_table

pytest.importorskip("trl")

IMPORT_PATH = os.pathsep.join(str(Path(__file__).resolve().parents[2] / d) for d in ("src", "."))


@pytest.mark.slow
def test_smoke_run_has_every_row_sharded_where_fsdp_and_half_the_state_with_cp2(tmp_path, capsys, monkeypatch):
    # The workers are fresh interpreters: make them import this checkout's package (a worktree's, too).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (IMPORT_PATH, os.environ.get("PYTHONPATH")) if p))
    out = tmp_path / "trl-scale.json"
    assert main(["trl-scale", "--smoke", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "trl-scale" and doc["smoke"] and doc["shape"]["model"] == SHAPES["smoke"].model
    rows = {r["id"]: r for r in doc["results"]}
    assert set(rows) == {row.id for row in ROWS}
    for row in rows.values():
        assert row["status"] == "ok", row
        assert len(row["ranks"]) == 2 and {r["rank"] for r in row["ranks"]} == {0, 1}
        for rank in row["ranks"]:
            assert rank["step_peak_bytes"] > 0 and rank["absolute_hwm_bytes"] > 0 and rank["time_s"] > 0
            # one group of G completions per rank, at the smoke shape
            assert rank["rows"] == SHAPES["smoke"].group_size and rank["prompt_tokens"] == SHAPES["smoke"].prompt_tokens
            # FSDP rows really ran sharded (DTensor parameters, accelerate's FSDP path), DDP rows did not
            assert rank["sharded"] is row["fsdp"] and rank["fsdp_enabled"] is row["fsdp"]
            assert rank["param_bytes"] * (2 if row["fsdp"] else 1) == pytest.approx(rank["full_param_bytes"], rel=0.01)
        assert (row["prompt_state_bytes"] is None) is (row["trainer"] == "trl")
        assert row["forecast"]["step_bytes"] > 0 and "longstraw plan" in row["forecast"]["command"]
    # The context-parallel ranks each backpropagate both groups, each holding half of the prompt's state:
    # 255 encoded positions split 128 + 127.
    cp1, cp2 = rows["longstraw-fsdp2"], rows["longstraw-fsdp2-cp2"]
    assert all(r["backward_tree_calls"] == 2 for r in cp2["ranks"])  # its block's two micro-batches
    assert sum(r["prompt_state_bytes"] for r in cp2["ranks"]) == cp1["prompt_state_bytes"]
    assert doc["checks"]["cp2_prompt_state_over_cp1"] == pytest.approx(0.5, abs=0.01)
    assert all(doc["checks"]["fsdp_rows_sharded"].values())
    assert "LongStraw FSDP2 + cp 2: ok" in capsys.readouterr().out
    table = format_table(doc)  # the table a real run prints, from the smoke document
    assert all(row.label in table for row in ROWS) and "prompt state, cp 2 / cp 1 (FSDP2): 0.502" in table


def test_the_planner_forecasts_each_row_with_its_own_command():
    shape = SHAPES["default"]
    by_id = {row.id: trl_scale.forecast(shape, row) for row in ROWS}
    assert by_id["trl-ddp"]["plan"] == "standard_batched" and "--no-shard" in by_id["trl-ddp"]["command"]
    assert "--no-shard" not in by_id["trl-fsdp2"]["command"]
    assert by_id["longstraw-fsdp2-cp2"]["plan"] == "exact" and "--cp 2" in by_id["longstraw-fsdp2-cp2"]["command"]
    # cp 2 halves the exact plan's prompt state in the forecast too (b1-llama, P = 8192: 16 MiB at cp 1)
    assert by_id["longstraw-fsdp2-cp2"]["prompt_state_bytes"] * 2 == by_id["longstraw-fsdp2"]["prompt_state_bytes"]
    assert "note" in by_id["longstraw-fsdp2"] and "note" not in by_id["trl-fsdp2"]
    unknown = trl_scale.forecast(trl_scale.Shape("tiny-llama", 64, 8, 2, 32, dtype="int4"), ROWS[0])
    assert unknown["step_bytes"] is None and "cannot express" in unknown["error"]


def test_without_the_trl_extra_it_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setattr(trl_scale, "missing_extra", lambda: ["trl"])
    assert main(["trl-scale", "--smoke"]) == 1
    assert "pip install 'longstraw[trl]'" in capsys.readouterr().err


def test_every_row_timing_out_replaces_no_earlier_results(tmp_path, capsys):
    """Both ranks killed by --timeout before any row finished: the earlier results file stays as it was, no new
    one is written, the failures are in the partial file, exit status 1."""
    out = tmp_path / "trl-scale.json"
    earlier = json.dumps({"bench": "trl-scale", "results": [{"id": "trl-ddp", "status": "ok"}]})
    out.write_text(earlier)
    assert main(["trl-scale", "--smoke", "--timeout", "0.01", "--out", str(out)]) == 1
    assert out.read_text() == earlier and sorted(p.name for p in tmp_path.iterdir()) == [out.name, out.name + ".tmp"]
    assert all(r["status"] == "failed" for r in json.loads((tmp_path / (out.name + ".tmp")).read_text())["results"])
    assert f"no row finished, so no results file is written ({out} is left as it was" in capsys.readouterr().err
