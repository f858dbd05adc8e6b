"""`python -m benchmarks cp --smoke`: C in {1, 2} as real gloo ranks; each rank holds its slice of the state."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import child_pids, running

from benchmarks.__main__ import main

IMPORT_PATH = os.pathsep.join(str(Path(__file__).resolve().parents[2] / d) for d in ("src", "."))
WORKER = "benchmarks.cp_worker"


@pytest.mark.slow
def test_bench_cp_smoke(tmp_path, capsys):
    out = tmp_path / "cp.json"
    assert main(["cp", "--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["cp"] for r in rows] == [1, 2] and len(rows[1]["ranks"]) == 2
    one, two = rows
    # 255 encoded positions in 8 capture chunks, split 4 + 4 chunks (128 + 127 positions)
    assert sum(r["prompt_state_bytes"] for r in two["ranks"]) == one["max_state_bytes"]
    assert two["max_state_bytes"] == one["max_state_bytes"] * 128 // 255
    assert all(r["peak_bytes"] > 0 and r["time_s"] > 0 for row in rows for r in row["ranks"])
    assert "C=2" in capsys.readouterr().out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads child processes from Linux's /proc")
def test_sigterm_ends_the_bench_and_its_ranks(tmp_path):
    """`timeout` sends SIGTERM: the bench stops with one line and status 143, and its rank processes end with it
    instead of running on."""
    code = "import sys; from benchmarks.__main__ import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, PYTHONPATH=IMPORT_PATH)
    proc = subprocess.Popen([sys.executable, "-c", code, "cp", "--smoke", "--out", str(tmp_path / "cp.json")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    ranks: list[int] = []
    deadline = time.monotonic() + 120
    while not ranks and time.monotonic() < deadline and proc.poll() is None:
        ranks = [c for c in child_pids(proc.pid) if WORKER in Path(f"/proc/{c}/cmdline").read_text()]
        time.sleep(0.05)
    assert ranks, "the bench did not start a rank"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in ranks)
