"""Launching benchmark workers: each measured configuration runs in a fresh `python -m benchmarks.<worker>` process.

Parent side: `worker_command` (the command line), `worker_env` (the environment: the allocator's threshold, the
repository root on PYTHONPATH so the child imports this package from any working directory), `rank_env` (torchrun's
variables for one rank of a gloo group on this host), `run_ranks` (start every rank, wait for all, end them all on
Ctrl-C or SIGTERM), `describe_exit` (a failed worker's exit status in words) and `busy_neighbours` (busy-loop
processes: a reproducible busy host). Worker side: `worker_args` (the worker's arguments or its usage line) and
`save_rows` (run a job's rows one after another, writing the results after each).
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parent.parent)  # the directory holding this package


def worker_command(worker: str, *args: str) -> list[str]:
    """The command line running module `benchmarks.<worker>` with `args` in this interpreter."""
    return [sys.executable, "-m", f"benchmarks.{worker}", *args]


def importable(env: dict[str, str]) -> dict[str, str]:
    """`env` with the repository root first on PYTHONPATH (a worker may start in a temporary directory)."""
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *paths])
    return env


def describe_exit(returncode: int) -> str:
    """A worker's exit status in words: the signal that ended it (SIGKILL: likely the OOM killer) or its status."""
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        # The kernel's OOM killer sends SIGKILL; so would a person, but during a bench that is rare.
        hint = " (likely out of memory)" if sig == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit status {returncode}"


def worker_env(malloc_mmap_threshold: int, smoke: bool = False,
               base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A worker's environment: `base` (default os.environ) with MALLOC_MMAP_THRESHOLD_ set to the threshold, or
    removed when it is 0 (glibc's default allocator, even where the caller's shell set one; module docstring).
    smoke: OMP_NUM_THREADS=1 unless set (a smoke run only checks that everything runs, and two OpenMP threads
    on a host whose cores are busy with other work slow it heavily). Everything else is inherited, OMP_WAIT_POLICY
    included (`longstraw.cli.passive_openmp_wait`), so every worker of a bench runs under the same policy."""
    env = importable(dict(os.environ if base is None else base))
    if malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(malloc_mmap_threshold)
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if smoke:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env




BUSY_LOOP = "while True: pass"  # one neighbour of `busy_neighbours`: a core's worth of competing work


@contextmanager
def busy_neighbours(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Run `n` busy-loop processes (`python -c "while True: pass"`) while the block runs: a reproducible busy host.
    They are killed and reaped when the block ends, also when it raises (KeyboardInterrupt included). n = 0: none."""
    if n < 0:
        raise ValueError(f"neighbours must be >= 0, got {n}")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: a gloo group's MASTER_PORT."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(base: Mapping[str, str], rank: int, world: int, port: int, **extra: str) -> dict[str, str]:
    """`base` with torchrun's variables for rank `rank` of `world` processes on this host (gloo on `port`), the
    repository root on PYTHONPATH, and `extra`."""
    return importable(dict(base, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                           LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **extra))


def run_ranks(cmd: list[str], envs: list[dict[str, str]], timeout_s: float | None,
              cwd: str | None = None) -> tuple[list[int], list[str], bool]:
    """Run `cmd` once per environment in `envs` (one process per rank, stdout and stderr together) and wait for all:
    (exit codes, outputs, timed out). On a timeout every rank is killed and its output kept; on Ctrl-C or SIGTERM
    raised in this process every rank is killed and reaped before the exception goes on."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
             for env in envs]
    timed_out = False
    try:
        outputs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outputs = [p.communicate()[0] for p in procs]
        timed_out = True
    except BaseException:
        for p in procs:
            p.kill()
            p.wait()
        raise
    return [int(p.returncode) for p in procs], outputs, timed_out


def worker_args(argv: list[str] | None, usage: str, count: int) -> list[str] | None:
    """The worker's `count` arguments (default: the command line's), or None after printing `usage` to stderr."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != count:
        print(f"usage: {usage}", file=sys.stderr)
        return None
    return args


def save_rows(job: dict[str, Any], out_path: str, run_row: Callable[[dict[str, Any], dict[str, Any]], Any]) -> None:
    """Run `run_row(job["shape"], row)` for each of the job's rows, writing the list of results to `out_path` after
    every row: a later row's failure keeps the earlier ones (a shared `--smoke` process)."""
    results = []
    for row in job["rows"]:
        results.append(run_row(job["shape"], row))
        with open(out_path, "w") as f:
            json.dump(results, f)
        gc.collect()
