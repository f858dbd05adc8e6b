"""Spawning ranks for the distributed tests: W plain processes on this machine with the environment torchrun
would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), gloo on CPU, bounded by a timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import longstraw

TESTS = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
# The ranks import the same longstraw as this process (a worktree's src on PYTHONPATH, not the editable install).
SRC = Path(longstraw.__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: list[str], world: int, timeout: float = 300.0, cwd: Path | None = None) -> list[tuple[int, str]]:
    """Run `python <args>` as `world` ranks; return (exit code, stdout+stderr) per rank. Kills all on timeout."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(TESTS), str(HERE), str(SRC)]))
        env.pop("TORCHELASTIC_RUN_ID", None)
        procs.append(subprocess.Popen([sys.executable, *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail(f"ranks did not finish within {timeout} s (a hang); their output:\n" + "\n---\n".join(outs))
    return results


@pytest.fixture(scope="session")
def spawn():
    return run_ranks
