"""`longstraw compare` locks its --out like `train` locks its --run-dir: a second comparison writing the same
directory is refused at once, naming the first's PID, before anything in it is touched; `train --nproc` refuses a
run_dir in use in the launcher, before any rank starts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import jsonl_dataset

import longstraw
from longstraw import cli
from longstraw.train.rundir import LOCK_FILE

SRC = Path(longstraw.__file__).resolve().parents[1]
HOLD = "import sys; from pathlib import Path; from longstraw.train.rundir import RunLock; " \
       "lock = RunLock.acquire(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()"


@contextmanager
def _held(path: Path) -> Iterator[subprocess.Popen]:
    """Another process holding `path`'s run lock until the block ends (its stdin closed: the kernel releases it)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=str(SRC)))
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.communicate("")
    assert holder.returncode == 0


def test_a_second_compare_on_the_same_out_is_refused_with_the_first_ones_pid(tmp_path, capsys):
    out = tmp_path / "cmp"
    out.mkdir()
    with _held(out) as holder:
        argv = ["compare", "--model", "tiny-llama", "--task", "jsonl", "--data", str(jsonl_dataset(tmp_path)),
                "--group-size", "2", "--max-new-tokens", "2", "--eval-prompts", "1", "--steps", "1", "--plans",
                "standard,detach", "--out", str(out)]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert f"--out {out} is in use by another longstraw process (PID {holder.pid} on host" in err, err
        assert sorted(p.name for p in out.iterdir()) == [".longstraw.lock"]  # nothing written or trained


def test_train_nproc_refuses_a_run_dir_in_use_before_starting_any_rank(tmp_path, capsys, monkeypatch):
    from longstraw.distributed import launch

    monkeypatch.setattr(launch, "launch_train", lambda *a: pytest.fail("ranks started on a run_dir in use"))
    run = tmp_path / "run"
    run.mkdir()
    with _held(run) as holder:
        argv = ["train", "--model", "tiny-llama", "--task", "jsonl", "--data", str(jsonl_dataset(tmp_path)),
                "--eval-prompts", "0", "--prompts-per-step", "2", "--run-dir", str(run), "--nproc", "2"]
        assert cli.main(argv) == 1
        assert capsys.readouterr().err == (f"longstraw train: error: run_dir {run} is in use by another longstraw "
                                           f"process (PID {holder.pid} on host {socket.gethostname()}, since "
                                           f"{(run / LOCK_FILE).read_text().split()[2]}): wait for it to end or stop "
                                           f"it (kill {holder.pid}), or choose another --run-dir\n")
