"""examples/trl_async.py offline: TRL's asynchronous trainer with LongStraw's tree, fed by the example's in-process
generate worker (TRL's worker and weight-transfer interfaces) on tiny-qwen3, two steps: it exits cleanly (its
sampling thread joined), logs each step, and each micro-batch's tree encodes fewer tokens than its samples hold."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'longstraw[trl]'")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_example_trains_two_steps_offline(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"), OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "trl_async.py"), "--steps", "2",
                          "--output-dir", str(tmp_path / "out")], capture_output=True, text=True, env=env,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "terminate called" not in run.stderr
    steps = re.findall(r"step (\d+): loss \S+, reward \S+, tokens encoded (\d+) of (\d+)", run.stdout)
    assert [s[0] for s in steps] == ["1", "2"], run.stdout
    assert all(int(encoded) < int(flattened) for _, encoded, flattened in steps)
