"""`train --nproc 2` and signals: SIGTERM or SIGINT to the launcher makes every rank finish its step and save it
(also with --save-every 0), and the launcher exit 128 + signal with one line and no traceback; a launcher killed
with SIGKILL takes its ranks with it (they get SIGTERM from the kernel, save and exit) instead of leaving them
training on their own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import longstraw
from longstraw.train.checkpoints import load_checkpoint
from longstraw.train.rundir import RunLock

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
SRC = Path(longstraw.__file__).resolve().parents[1]  # the children import the longstraw this process tests


def _args(tmp_path: Path, run: Path, *extra: str) -> list[str]:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say something about {w}.", "answer": w}) + "\n"
                            for w in ("cats", "rain", "maps", "tea")))
    return [sys.executable, "-m", "longstraw.cli", "train", "--model", "tiny-llama", "--task", "jsonl", "--data",
            str(data), "--reward-fn", "rewards_for_tests:even_byte_fraction", "--group-size", "3",
            "--max-new-tokens", "4", "--lr", "1e-3", "--eval-prompts", "0", "--no-plot", "--chunk-size", "8",
            "--prompts-per-step", "2", "--steps", "100000", "--save-every", "0", "--run-dir", str(run),
            "--nproc", "2", *extra]


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    """The launcher, its output (and its ranks', which inherit it) in `log`: a file, not a pipe, so that ranks
    outliving their launcher cannot hold the test up."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(HERE), str(SRC)]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "LONGSTRAW_LAUNCHER_PID"):
        env.pop(key, None)
    with log.open("ab") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=log.parent)


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.endswith("}")]


def _wait_rows(run: Path, n: int, proc: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while len(_steps(run)) < n:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as ended)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _check_saved(run: Path) -> int:
    """The checkpoint is the last step with a metrics row, and every step has exactly one row."""
    saved = int(load_checkpoint(run)["step"])
    assert saved >= 1 and _steps(run) == list(range(1, saved + 1)), (saved, _steps(run))
    return saved


@pytest.mark.slow
def test_sigterm_saves_and_exits_143_and_a_killed_launcher_takes_its_ranks(tmp_path):
    """One run, two launches (each launch costs ~20 s of start-up on a small host):
    1. SIGTERM to the launcher with --save-every 0: the ranks finish the step and save it together; the launcher
       exits 143 with one line, no traceback, none of torchrun's notes on the signal.
    2. --resume, then SIGKILL to the launcher: both ranks are gone within seconds, having saved the last completed
       step (every step's metrics row once, the rows the first checkpoint covers untouched); the run directory's
       lock went with them."""
    run = tmp_path / "run"
    log = tmp_path / "term.log"
    proc = _start(_args(tmp_path, run), log)
    _wait_rows(run, 2, proc, log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()
    text = log.read_text()
    assert "Traceback" not in text and "SignalException" not in text and "death signal" not in text, text
    assert text.count("longstraw train: stopped by SIGTERM") == 1, text  # the launcher's line; the ranks say none
    first = _check_saved(run)
    assert f"the last completed step ({first}) is saved" in text, text
    rows = (run / "metrics.jsonl").read_text().splitlines()

    log = tmp_path / "kill.log"
    proc = _start(_args(tmp_path, run, "--resume"), log)
    _wait_rows(run, first + 1, proc, log)
    ranks = [p for p in _children(proc.pid) if b"longstraw.cli" in (Path("/proc") / str(p) / "cmdline").read_bytes()]
    assert len(ranks) == 2, (ranks, log.read_text())
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = [p for p in ranks if _alive(p)]
    for p in alive:  # never leave them behind, even when the test fails
        os.kill(p, signal.SIGKILL)
    assert not alive, log.read_text()
    assert _check_saved(run) > first
    assert (run / "metrics.jsonl").read_text().splitlines()[:first] == rows  # the covered rows are untouched
    RunLock.acquire(run).release()  # not refused: the lock ended with its holder


def test_a_signal_to_the_launcher_is_one_line_and_its_status(monkeypatch, capsys):
    """What the launcher does once torchrun's agent has forwarded SIGINT or SIGTERM and the ranks have ended."""
    monkeypatch.delenv("LONGSTRAW_LAUNCHER_PID", raising=False)
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from longstraw.distributed import launch
    from longstraw.distributed.runtime import LAUNCHER_PID_ENV

    for sig in (signal.SIGINT, signal.SIGTERM):
        def stopped(args, sig=sig):
            raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)

        monkeypatch.setattr(torch.distributed.run, "run", stopped)
        assert launch.launch_train(["--steps", "1"], 2) == 128 + sig
        assert capsys.readouterr().err == f"longstraw train: stopped by {sig.name}\n"
        assert LAUNCHER_PID_ENV not in os.environ  # not left for what this process starts later
