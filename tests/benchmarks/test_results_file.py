"""`write_results`, every bench's last write: only with a finished row, never over an earlier file of more."""

from __future__ import annotations

import json

from benchmarks.common import finish_run, finished_rows, write_results


def _doc(*statuses: str) -> dict:
    return {"bench": "x", "results": [{"status": s} for s in statuses]}


def test_a_results_file_is_written_only_with_a_finished_row_and_never_over_more(tmp_path, capsys):
    out = str(tmp_path / "r.json")
    assert write_results(out, _doc("failed", "timeout"), "bench x") is None  # nothing finished: nothing written
    assert not (tmp_path / "r.json").exists() and "bench x: no row finished" in capsys.readouterr().err
    assert write_results(out, _doc("ok", "failed"), "bench x") == out  # a new file
    assert write_results(out, _doc("ok", "skipped"), "bench x") == out  # more finished rows: replaces it
    assert finished_rows(json.loads((tmp_path / "r.json").read_text())) == 2
    capsys.readouterr()
    beside = write_results(out, _doc("ok", "timeout"), "bench x")  # fewer: a new name beside it, said
    assert beside is not None and beside != out and beside.startswith(str(tmp_path / "r-"))
    assert finished_rows(json.loads((tmp_path / "r.json").read_text())) == 2
    assert f"{out} holds 2 finished rows and this run finished 1: it is kept, and the results go to {beside}" \
        in capsys.readouterr().err
    again = write_results(out, _doc("ok"), "bench x")  # the same second: yet another name, nothing replaced
    assert again not in (out, beside) and finished_rows(json.loads((tmp_path / "r.json").read_text())) == 2
    (tmp_path / "mine.json").write_text("not json")  # a file that is not a results document is never replaced
    other = write_results(str(tmp_path / "mine.json"), _doc("ok"), "bench x")
    assert other != str(tmp_path / "mine.json") and (tmp_path / "mine.json").read_text() == "not json"
    assert "is not a results file" in capsys.readouterr().err
    assert finished_rows({"bench": "provenance", "result": {"x": 1}}) == 1  # a document of one result


def test_finish_run_stamps_prints_and_writes_into_a_new_folder(tmp_path, capsys):
    out = str(tmp_path / "new" / "r.json")
    assert finish_run(_doc("ok"), lambda d: f"table of {len(d['results'])}", out, "bench x") == 0
    written = json.loads((tmp_path / "new" / "r.json").read_text())
    assert "finished" in written and capsys.readouterr().out == "table of 1\n"
    assert finish_run(_doc("failed"), lambda d: "", str(tmp_path / "other.json"), "bench x") == 1  # nothing finished
    assert not (tmp_path / "other.json").exists()
