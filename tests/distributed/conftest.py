"""Spawning ranks for the distributed tests: W plain processes on this machine with the environment torchrun
would give them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), gloo on CPU, bounded by a timeout
(`helpers.run_ranks`), importing this checkout's tests and src."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from helpers import run_ranks

import longstraw

TESTS = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
# The ranks import the same longstraw as this process (a worktree's src on PYTHONPATH, not the editable install).
SRC = Path(longstraw.__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def spawn():
    return functools.partial(run_ranks, paths=[TESTS, HERE, SRC])
