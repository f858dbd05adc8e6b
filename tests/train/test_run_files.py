"""The run's files when the disk or the files themselves fail: a full disk names ENOSPC and the file in one line and
keeps the previous checkpoint; summary.json is strict JSON (null, not NaN) and written whole; a summary.json cut short
is named with its path when a run directory is read."""

from __future__ import annotations

import errno
import io
import json
from pathlib import Path

import pytest
import torch

import longstraw.train.checkpoints as checkpoints
from longstraw import cli
from longstraw.train.checkpoints import CheckpointWriteError, load_checkpoint, save_checkpoint, tmp_path_of
from longstraw.train.config import TrainConfig
from longstraw.train.reporting import Report, write_summary
from longstraw.train.rundir import read_summary


class FullDisk(io.RawIOBase):
    """A file whose writes fail with ENOSPC once `room` bytes are written (what a full disk does)."""

    def __init__(self, path: Path, room: int) -> None:
        self.f, self.room = open(path, "wb"), room  # noqa: SIM115 - closed by close()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def fileno(self) -> int:
        return self.f.fileno()

    def close(self) -> None:
        self.f.close()
        super().close()


def full_disk_after(monkeypatch, saves: int, room: int = 4096) -> None:
    """The checkpoint writes after the first `saves` find the disk full."""
    count = [0]

    def opened(path, *args, **kwargs):
        count[0] += 1
        if count[0] > saves and "w" in (args[0] if args else kwargs.get("mode", "r")):
            return FullDisk(Path(path), room)
        return open(path, *args, **kwargs)

    monkeypatch.setattr(checkpoints, "open", opened, raising=False)


def _strict(text: str):
    def refuse(constant):
        raise AssertionError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_full_disk_names_enospc_and_the_file_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"step": 1, "weights": torch.ones(4)})
    full_disk_after(monkeypatch, 0)
    with pytest.raises(CheckpointWriteError) as err:
        save_checkpoint(tmp_path, {"step": 2, "weights": torch.zeros(100_000)})
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"cannot write {tmp_path / 'checkpoint.pt'}: ENOSPC")
    assert f"the previous checkpoint {tmp_path / 'checkpoint.pt'} is intact" in message
    kept = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert kept["step"] == 1 and torch.equal(kept["weights"], torch.ones(4))  # intact
    assert not tmp_path_of(tmp_path).exists()  # the partial file does not keep the space a retry needs


def test_a_full_disk_at_the_first_checkpoint_says_none_was_written(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    with pytest.raises(CheckpointWriteError, match="ENOSPC .*no checkpoint was written before this one"):
        save_checkpoint(tmp_path, {"step": 1})
    assert not any(tmp_path.iterdir())


def _run(run: Path, *extra: str) -> list[str]:
    return ["train", "--model", "tiny-llama", "--task", "passkey", "--prompt-tokens", "300", "--group-size", "2",
            "--max-new-tokens", "2", "--eval-prompts", "0", "--no-plot", "--chunk-size", "64", "--run-dir", str(run),
            *extra]


def test_a_run_that_fills_the_disk_ends_with_one_line_and_its_last_checkpoint(tmp_path, monkeypatch, capsys):
    """Step 1 is saved (--save-every 1); the disk is full when step 2 is: one error line naming ENOSPC and the file,
    status 1, no traceback, step 1's checkpoint intact and resumable."""
    run = tmp_path / "run"
    full_disk_after(monkeypatch, 1)
    assert cli.main(_run(run, "--steps", "2", "--save-every", "1")) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error" in line or "ENOSPC" in line or "save" in line]
    assert errors == [f"longstraw train: error: cannot write {run / 'checkpoint.pt'}: ENOSPC (No space left on "
                      f"device); free some space; the previous checkpoint {run / 'checkpoint.pt'} is intact"], err
    assert "Traceback" not in err
    assert load_checkpoint(run)["step"] == 1


def test_summary_json_is_strict_json(tmp_path):
    """--eval-prompts 0 leaves the held-out rewards undefined (NaN in memory): null in summary.json, which any JSON
    reader reads (NaN is no JSON)."""
    run = tmp_path / "run"
    assert cli.main(_run(run, "--steps", "1")) == 0
    summary = _strict((run / "summary.json").read_text())
    assert summary["eval_before"] is None and summary["eval_after"] is None and summary["steps"] == 1
    write_summary(tmp_path / "s.json", {"a": [1.5, float("inf")], "b": {"c": -float("inf")}, "d": (float("nan"),)})
    assert _strict((tmp_path / "s.json").read_text()) == {"a": [1.5, None], "b": {"c": None}, "d": [None]}


def test_summary_json_on_a_full_disk_is_one_line_and_leaves_no_half_file(tmp_path, monkeypatch):
    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(ValueError, match=f"cannot write {tmp_path / 'summary.json'}: ENOSPC"):
        write_summary(tmp_path / "summary.json", {"steps": 1})
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("text", ['{"steps": 3, "eval_af', "", "[1, 2]"], ids=["cut", "empty", "not-an-object"])
def test_a_cut_summary_json_is_named_with_its_path(tmp_path, text):
    path = tmp_path / "summary.json"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        read_summary(path)
    assert str(err.value).startswith(f"{path} ") and "\n" not in str(err.value)


def test_resume_names_a_cut_summary_json_in_one_note_and_writes_it_again(tmp_path, capsys):
    run = tmp_path / "run"
    assert cli.main(_run(run, "--steps", "1")) == 0
    (run / "summary.json").write_text('{"steps": 1, "eval_bef')
    capsys.readouterr()
    assert cli.main(_run(run, "--steps", "2", "--resume")) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "summary.json" in line]
    assert notes and notes[0].startswith(f"note: {run / 'summary.json'} is cut short or damaged"), notes
    assert read_summary(run / "summary.json")["steps"] == 2


def test_the_report_reads_summary_json_through_read_summary(tmp_path):
    """The agent results' report names a cut summary.json instead of a JSONDecodeError."""
    from benchmarks.agent_results import run_results

    (tmp_path / "summary.json").write_text('{"eval_before": 0.0, ')
    with pytest.raises(ValueError, match=f"{tmp_path / 'summary.json'} is cut short or damaged"):
        run_results(tmp_path)


def test_metrics_on_a_full_disk_name_the_file(tmp_path, monkeypatch):
    report = Report(TrainConfig.from_flat(run_dir=str(tmp_path), plot=False), tmp_path, enabled=True)

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Path, "open", full)
    with pytest.raises(ValueError, match=f"cannot write {tmp_path / 'metrics.jsonl'}: ENOSPC .*step 4 is not"):
        report.write({"step": 4})
