"""`train --nproc` refuses a run_dir in use in the launcher, before any rank starts. (The same lock on
`python -m benchmarks compare`'s --out: tests/benchmarks/test_compare.py.)"""

from __future__ import annotations

import socket

import pytest
from helpers import held_run_lock, jsonl_dataset

from longstraw import cli
from longstraw.train.rundir import LOCK_FILE


def test_train_nproc_refuses_a_run_dir_in_use_before_starting_any_rank(tmp_path, capsys, monkeypatch):
    from longstraw.distributed import launch

    monkeypatch.setattr(launch, "launch_train", lambda *a: pytest.fail("ranks started on a run_dir in use"))
    run = tmp_path / "run"
    run.mkdir()
    with held_run_lock(run) as holder:
        argv = ["train", "--model", "tiny-llama", "--task", "jsonl", "--data", str(jsonl_dataset(tmp_path)),
                "--eval-prompts", "0", "--prompts-per-step", "2", "--run-dir", str(run), "--nproc", "2"]
        assert cli.main(argv) == 1
        assert capsys.readouterr().err == (f"longstraw train: error: run_dir {run} is in use by another longstraw "
                                           f"process (PID {holder.pid} on host {socket.gethostname()}, since "
                                           f"{(run / LOCK_FILE).read_text().split()[2]}): wait for it to end or stop "
                                           f"it (kill {holder.pid}), or choose another --run-dir\n")
