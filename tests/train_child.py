"""`longstraw` commands in child processes forked from a server that has already imported torch and the trainer
(multiprocessing's forkserver, preloading this module): tests start many short runs without paying the ~5 s
import each time. Used by the fault-injection and error-path tests.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

import torch

import longstraw.cli
import longstraw.train.trainer  # noqa: F401 - preloaded in the fork server with this module

HERE = Path(__file__).parent


def context() -> multiprocessing.context.BaseContext:
    """The forkserver context with this module preloaded (the server starts on the first child)."""
    # Python 3.11's fork server ignores the parent's sys.path, and a preload that fails to import is skipped
    # silently (every child would then import torch itself): put this directory on the server's PYTHONPATH.
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(HERE) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE), *[p for p in paths if p]])
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["train_child"])
    return ctx


def start(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> multiprocessing.Process:
    """`longstraw <argv>` in a forked child; its stdout and stderr go to `log_path` (appended)."""
    proc = context().Process(target=run_cli, args=(argv, env or {}, str(log_path)))
    proc.start()
    return proc


def run(argv: list[str], log_path: Path, env: dict[str, str] | None = None, timeout_s: float = 300) -> int:
    """`start` and wait; the child's exit status (negative: killed by that signal)."""
    proc = start(argv, log_path, env)
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise TimeoutError(f"longstraw {' '.join(argv)} ran past {timeout_s} s; log: {log_path}")
    return proc.exitcode


def run_cli(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """The child: `longstraw <argv>` with `env` added to the environment, output in `log_path`.

    One intra-op thread: the same in every child (bit-identical results need the same reduction order), and
    on a busy 2-core host OpenMP's spinning barriers make a tiny model's step ~100x slower with 2 threads.
    """
    torch.set_num_threads(1)
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.exit(longstraw.cli.main(argv))
