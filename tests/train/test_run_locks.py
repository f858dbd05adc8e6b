"""`longstraw compare` locks its --out like `train` locks its --run-dir: a second comparison writing the same
directory is refused at once, naming the first's PID, before anything in it is touched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers import jsonl_dataset

import longstraw
from longstraw import cli

SRC = Path(longstraw.__file__).resolve().parents[1]
HOLD = "import sys; from pathlib import Path; from longstraw.train.rundir import RunLock; " \
       "lock = RunLock.acquire(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()"


def test_a_second_compare_on_the_same_out_is_refused_with_the_first_ones_pid(tmp_path, capsys):
    out = tmp_path / "cmp"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=str(SRC)))
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        argv = ["compare", "--model", "tiny-llama", "--task", "jsonl", "--data", str(jsonl_dataset(tmp_path)),
                "--group-size", "2", "--max-new-tokens", "2", "--eval-prompts", "1", "--steps", "1", "--plans",
                "standard,detach", "--out", str(out)]
        assert cli.main(argv) == 1
        err = capsys.readouterr().err
        assert f"--out {out} is in use by another longstraw process (PID {holder.pid} on host" in err, err
        assert sorted(p.name for p in out.iterdir()) == [".longstraw.lock"]  # nothing written or trained
    finally:
        holder.communicate("")  # stdin closed: the holder ends, and the kernel releases its lock
    assert holder.returncode == 0
