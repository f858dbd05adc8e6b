"""`longstraw train ... --nproc N`: start N ranks on this machine through torchrun's own launcher.

It is exactly `torchrun --standalone --nproc-per-node N -m longstraw.cli train ...` (torch.distributed.run's
API, called in-process): torchrun's agent starts the workers, sets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_ADDR / MASTER_PORT, stops the others when one fails and reports which rank failed and why. For several
machines, run torchrun yourself with its rendezvous flags (docs/distributed.md).
"""

from __future__ import annotations

import torch


def strip_nproc(argv: list[str]) -> list[str]:
    """`argv` without `--nproc N` / `--nproc=N` (the workers must not launch again)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def check_nproc(nproc: int, device: str, prompts_per_step: int, cp: int = 1) -> None:
    """Refuse a process count the machine or the data cannot serve, with what to change."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if nproc % cp:
        raise ValueError(f"--cp {cp} needs --nproc to be a multiple of {cp}, got {nproc}: use --nproc "
                         f"{cp * max(1, nproc // cp)} or a --cp that divides {nproc}")
    if torch.device(device).type == "cuda":
        count = torch.cuda.device_count()
        if nproc > count:
            raise ValueError(
                f"--nproc {nproc} needs {nproc} GPUs (one per process) but this machine has {count}: "
                f"use --nproc {count} or fewer"
            )
    elif torch.device(device).type != "cpu":
        raise ValueError(f"--nproc supports --device cpu (gloo) and cuda (nccl), got {device!r}")
    groups = nproc // cp  # data-parallel groups of ranks (each group of cp ranks shares its prompts)
    if prompts_per_step % groups:
        raise ValueError(
            f"--prompts-per-step {prompts_per_step} cannot be split evenly over {groups} data-parallel groups "
            f"(--nproc {nproc} / --cp {cp}): use a multiple of {groups} (e.g. --prompts-per-step "
            f"{groups * max(1, prompts_per_step // groups)}) or a process count that divides {prompts_per_step}"
        )


def launch_train(train_argv: list[str], nproc: int) -> None:
    """Run `longstraw train <train_argv>` as `nproc` ranks on this machine; raises torch's `ChildFailedError`
    (which names the failed rank and its error) if any rank fails."""
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--module", "longstraw.cli", "train", *train_argv]
    )
    run(args)
