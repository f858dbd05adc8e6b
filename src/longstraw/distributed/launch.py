"""`longstraw train ... --nproc N`: start N ranks on this machine through torchrun's own launcher.

It is exactly `torchrun --standalone --nproc-per-node N -m longstraw.cli train ...` (torch.distributed.run's API, called
in-process): torchrun's agent starts the workers with their RANK / WORLD_SIZE / ... environment, stops the others when
one fails, and says which and why. Several machines: torchrun with its rendezvous flags (docs/distributed.md).

Stopping: SIGTERM or SIGINT to the launcher is forwarded by torchrun's agent to every rank (each in its own session, so
a terminal's Ctrl-C reaches the launcher only); the ranks finish the current step, save it together and exit, and the
launcher then exits 128 + signal with one line. The agent waits `SHUTDOWN_TIMEOUT_S` for that (torchrun's own default of
30 s is too short for a large step and its checkpoint) before it kills the ranks; a second signal stops the ranks at
once. If the launcher itself is killed, the ranks get SIGTERM from the kernel (`end_with_launcher`) and do the same."""

from __future__ import annotations

import logging
import os
import signal
import sys

import torch

from longstraw.distributed.context import check_blocks
from longstraw.distributed.runtime import LAUNCHER_PID_ENV, backend_for

SHUTDOWN_TIMEOUT_S = 900  # seconds the agent waits for the ranks to save and exit after forwarding a signal
# torchrun's loggers that note a signal's forwarding ("Received 15 death signal, shutting down workers", "Closing
# process 123 via signal SIGTERM"): those notes are replaced by one line.
AGENT_LOGGERS = ("torch.distributed.elastic.agent.server.api", "torch.distributed.elastic.multiprocessing.api")
SIGNAL_NOTES = ("Received %s death signal", "Closing process %s via signal")


def _drop_signal_notes(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(SIGNAL_NOTES)


def strip_nproc(argv: list[str]) -> list[str]:
    """`argv` without `--nproc N` / `--nproc=N` (the workers must not launch again)."""
    out, args = [], iter(argv)
    for arg in args:
        if arg == "--nproc":
            next(args, None)
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def check_nproc(nproc: int, device: str, prompts_per_step: int, cp: int = 1, tp: int = 1) -> None:
    """Refuse a process count the machine or the data cannot serve, with what to change."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    check_blocks(nproc, cp, tp)
    if backend_for(device) == "nccl" and nproc > (count := torch.cuda.device_count()):
        raise ValueError(f"--nproc {nproc} needs {nproc} GPUs (one per process) but this machine has {count}: "
                         f"use --nproc {count} or fewer")
    groups = nproc // (cp * tp)  # data-parallel groups of ranks (each group of cp * tp ranks shares its prompts)
    if prompts_per_step % groups:
        raise ValueError(f"--prompts-per-step {prompts_per_step} cannot be split evenly over {groups} data-parallel "
                         f"groups (--nproc {nproc} / (--cp {cp} x --tp {tp})): use a multiple of {groups} (e.g. "
                         f"--prompts-per-step {groups * max(1, prompts_per_step // groups)}) or a process count that "
                         f"divides {prompts_per_step}")


def launch_train(train_argv: list[str], nproc: int) -> int:
    """Run `longstraw train <train_argv>` as `nproc` ranks on this machine; returns 0, or 128 + signal when SIGTERM
    or SIGINT stopped it (one line on stderr; the ranks saved the last completed step). Raises torch's
    `ChildFailedError` (which names the failed rank and its error) if any rank fails."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(["--standalone", f"--nproc-per-node={nproc}", "--module", "longstraw.cli",
                                         "train", *train_argv])
    # The ranks inherit this environment: they check that their parent is still this process. Restored after, so
    # that nothing else this process starts later takes it for its launcher.
    env = {LAUNCHER_PID_ENV: str(os.getpid()),
           "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(SHUTDOWN_TIMEOUT_S))}
    before = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    for name in AGENT_LOGGERS:  # its notes on a signal say what the line below says; everything else still shows
        logging.getLogger(name).addFilter(_drop_signal_notes)
    try:
        run(args)
    except SignalException as err:
        print(f"longstraw train: stopped by {signal.Signals(err.sigval).name}", file=sys.stderr)
        return 128 + int(err.sigval)
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return 0
