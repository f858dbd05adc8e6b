"""The run directory: refused early when reused, a file or unwritable; config changes on resume; metrics repair."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import train_child

import longstraw.train.trainer
from longstraw.train.config import TrainConfig
from longstraw.train.rundir import LOCK_FILE, check_resume_config, truncate_metrics
from longstraw.train.trainer import Trainer


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: these checks must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the run directory was checked")
    monkeypatch.setattr(longstraw.train.trainer, "load_model", refuse)


def _cfg(run: Path, **kw) -> TrainConfig:
    return TrainConfig.from_flat(run_dir=str(run), steps=1, eval_prompts=0, plot=False, **kw)


def test_a_run_dir_holding_a_run_is_refused_without_resume_or_overwrite(tmp_path, no_model):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "checkpoint.pt").write_bytes(b"x")
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="already holds a run .*add --resume to continue it, --overwrite"):
        Trainer(_cfg(run))
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched
    with pytest.raises(AssertionError, match="model was loaded"):  # --overwrite clears LongStraw's files only
        Trainer(_cfg(run, overwrite=True))
    assert sorted(p.name for p in run.iterdir()) == [LOCK_FILE, "notes.txt"]  # the lock file is not a run output
    with pytest.raises(ValueError, match="give only one"):
        Trainer(_cfg(run, overwrite=True, resume=True))


def test_a_run_dir_that_is_a_file_or_cannot_be_written_is_refused(tmp_path, no_model):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        Trainer(_cfg(afile))
    with pytest.raises(ValueError, match="cannot create run_dir"):
        Trainer(_cfg(afile / "run"))
    if os.geteuid() == 0:  # root writes anywhere permissions allow nothing; sysfs refuses new files even to root
        locked = Path("/sys/kernel")
    else:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
    with pytest.raises(ValueError, match=f"run_dir {locked} is not writable"):
        Trainer(_cfg(locked))


def test_resume_without_a_checkpoint_says_what_to_do(tmp_path, no_model):
    with pytest.raises(FileNotFoundError, match="run without --resume"):
        Trainer(_cfg(tmp_path / "none", resume=True))
    run = tmp_path / "early"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')  # killed before its first checkpoint
    with pytest.raises(FileNotFoundError, match="stopped before its first checkpoint .*--overwrite instead"):
        Trainer(_cfg(run, resume=True))


@pytest.mark.parametrize("device", ["banana", "cuda" if not torch.cuda.is_available() else "cuda:999"])
def test_a_bad_device_is_refused_before_the_run_dir_exists(tmp_path, device):
    run = tmp_path / "run"
    code = train_child.run(["train", "--device", device, "--run-dir", str(run)], tmp_path / "log")
    log = (tmp_path / "log").read_text()
    assert code == 2 and f"device {device!r}" in log and "Traceback" not in log, log
    assert not run.exists()


@pytest.mark.parametrize("argv,message", [
    (["--model", "/nonexistent"], "--model: model '/nonexistent' is not a preset"),
    (["--model", "tiny-llama", "--prompt-tokens", "999999"],
     "--prompt-tokens 999999 + --max-new-tokens 16 exceed the 2048 positions of model 'tiny-llama'"),
])
def test_a_bad_model_is_refused_before_the_run_dir_exists(tmp_path, capsys, argv, message):
    from longstraw import cli

    run = tmp_path / "run"
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", *argv, "--run-dir", str(run)])
    assert stop.value.code == 2 and message in capsys.readouterr().err
    assert not run.exists()


def test_config_changes_on_resume():
    saved = TrainConfig().to_flat()
    assert check_resume_config(saved, dict(saved, run_dir="elsewhere", eval_prompts=0), False, "ck") == []
    notes = check_resume_config(saved, dict(saved, chunk_size=64, steps=40), False, "ck")
    assert notes == ["note: resuming with changed settings: chunk_size: 2048 -> 64; steps: 20 -> 40"]
    changed = dict(saved, task="kv", loss="dapo", group_size=4)
    with pytest.raises(ValueError, match=r"change what is trained: task: 'passkey' -> 'kv'; group_size: 8 -> 4; "
                                         r"loss: 'grpo' -> 'dapo'\. .*add --force"):
        check_resume_config(saved, changed, False, "ck")
    assert check_resume_config(saved, changed, True, "ck")[0].startswith("--force: continuing with changed")
    with pytest.raises(ValueError, match="checkpoint ck was trained from model 'tiny-qwen3', not 'tiny-llama'"):
        check_resume_config(saved, dict(saved, model="tiny-llama", lr=1.0), False, "ck")


def test_resuming_another_model_is_a_clear_error(tmp_path):
    """Another model name: refused before the model loads; with --force, its shapes are compared first."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "Say something.", "answer": "ok"}) + "\n")
    common = ["train", "--task", "jsonl", "--data", str(data), "--group-size", "2", "--max-new-tokens", "2",
              "--eval-prompts", "0", "--no-plot", "--steps", "2", "--run-dir", str(tmp_path / "run")]
    assert train_child.run([*common, "--model", "tiny-llama", "--stop-after", "1"], tmp_path / "log") == 0
    code = train_child.run([*common, "--model", "tiny-qwen3", "--resume"], tmp_path / "log2")
    log = (tmp_path / "log2").read_text()
    assert code == 1 and "was trained from model 'tiny-llama', not 'tiny-qwen3'" in log, log
    code = train_child.run([*common, "--model", "tiny-qwen3", "--resume", "--force"], tmp_path / "log3")
    log = (tmp_path / "log3").read_text()
    assert code == 1 and "holds another model than this run's" in log, log
    assert "size mismatch" not in log and "Traceback" not in log


def test_metrics_are_truncated_to_the_checkpoint_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": 0.1 * s}) for s in (1, 2, 3, 3, 4, 5)]
    path.write_text("\n".join(rows) + '\n{"step": 6, "lo')  # a duplicate and a row cut short by a kill
    assert truncate_metrics(path, 3) == 4
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3]
    assert truncate_metrics(path, 3) == 0


def test_a_metrics_file_that_is_not_utf8_names_file_and_line_on_resume(tmp_path, capsys, monkeypatch):
    """Bytes that are not UTF-8 in metrics.jsonl: one line naming the file and line, before the model loads, not
    "'utf-8' codec can't decode ..." naming nothing."""
    from longstraw import cli

    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "Say something.", "answer": "ok"}) + "\n")
    run = tmp_path / "run"
    common = ["train", "--model", "tiny-llama", "--task", "jsonl", "--data", str(data), "--group-size", "2",
              "--max-new-tokens", "2", "--eval-prompts", "0", "--no-plot", "--steps", "2", "--run-dir", str(run)]
    assert cli.main([*common, "--stop-after", "1"]) == 0
    metrics = run / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes() + b'{"step": 2, "note": "caf\xe9"}\n')
    capsys.readouterr()

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before metrics.jsonl was checked")
    monkeypatch.setattr(longstraw.train.trainer, "load_model", refuse)
    assert cli.main([*common, "--resume"]) == 1
    err = capsys.readouterr().err
    assert f"{metrics}:2: not UTF-8 (byte 0xe9)" in err and "codec" not in err and "Traceback" not in err, err


def _tiny_run(data: Path, run: Path, steps: int, *extra: str) -> list[str]:
    return ["train", "--model", "tiny-llama", "--task", "jsonl", "--data", str(data), "--reward-fn",
            "rewards_for_tests:even_byte_fraction", "--group-size", "2", "--max-new-tokens", "2", "--lr", "1e-3",
            "--eval-prompts", "0", "--no-plot", "--chunk-size", "8", "--steps", str(steps), "--run-dir", str(run),
            *extra]


def _metric_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.endswith("}")] if path.exists() else []


def test_a_second_writer_is_refused_with_the_first_ones_pid_then_resumes_once_it_ended(tmp_path, capsys):
    """Two processes on one run directory: the second (with or without --resume) is refused at once, naming the
    first's PID and host, and touches nothing; once the first is SIGKILLed the kernel has released the lock, and
    the next writer takes it over with a note naming the dead PID. Then rows past the checkpoint (what ranks left
    running after their launcher died used to add) are dropped on resume, the rows the checkpoint covers are kept
    byte for byte, and summary.json's step count is metrics.jsonl's last step."""
    import signal
    import socket
    import time

    from longstraw.train.checkpoints import load_checkpoint
    from longstraw.train.rundir import RunLock

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say {w}.", "answer": w}) + "\n" for w in ("a", "b", "c")))
    run = tmp_path / "run"
    holder = train_child.start(_tiny_run(data, run, 100_000, "--save-every", "1"), tmp_path / "holder.log")
    deadline = time.monotonic() + 120
    while not (run / "checkpoint.pt").exists():
        assert holder.is_alive() and time.monotonic() < deadline, (tmp_path / "holder.log").read_text()
        time.sleep(0.01)
    for extra in (["--resume"], []):
        log = tmp_path / f"second{len(extra)}.log"
        assert train_child.run(_tiny_run(data, run, 100_000, *extra), log) == 1
        text = log.read_text()
        assert f"run_dir {run} is in use by another longstraw process (PID {holder.pid} on host " \
               f"{socket.gethostname()}" in text and f"(kill {holder.pid})" in text, text
        assert "Traceback" not in text and "resumed from" not in text
    assert holder.is_alive()  # the refused processes did not disturb it
    os.kill(holder.pid, signal.SIGKILL)
    holder.join()

    capsys.readouterr()
    RunLock.acquire(run).release()  # released by the kernel: taken over, with a note naming the dead holder
    assert f"taking over the lock of PID {holder.pid} on host {socket.gethostname()}" in capsys.readouterr().err
    assert (run / LOCK_FILE).read_text() == ""  # a clean release leaves no holder behind
    RunLock.acquire(run).release()
    assert capsys.readouterr().err == ""

    saved = load_checkpoint(run)["step"]
    kept = (run / "metrics.jsonl").read_text().splitlines()[:saved]
    with (run / "metrics.jsonl").open("a") as f:  # rows past the checkpoint, as a second writer would leave them
        f.write("".join(json.dumps({"step": s, "loss": -1.0}) + "\n" for s in range(saved + 1, saved + 4)))
    assert train_child.run(_tiny_run(data, run, saved + 2, "--resume"), tmp_path / "resume.log") == 0
    assert _metric_steps(run) == list(range(1, saved + 3))
    assert (run / "metrics.jsonl").read_text().splitlines()[:saved] == kept
    assert json.loads((run / "summary.json").read_text())["steps"] == saved + 2 == _metric_steps(run)[-1]


def test_summary_json_and_metrics_jsonl_always_agree(tmp_path, capsys):
    """The final report: rows past the run's last step are removed before summary.json is written; a gap (rows
    missing) is said."""
    from longstraw.train.reporting import Report

    report = Report(_cfg(tmp_path), tmp_path, enabled=True)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)))
    report.finish({"steps": 3, "eval_after": 0.0})
    assert _metric_steps(tmp_path) == [1, 2, 3]
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 3
    assert "rows are missing" not in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    report.finish({"steps": 3, "eval_after": 0.0})
    assert "metrics.jsonl ends at step 1, the run at step 3: rows are missing" in capsys.readouterr().err
