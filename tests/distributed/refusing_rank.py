"""A rank of `longstraw train` (argv: its options) that says, as the very last thing before the interpreter ends,
whether its process group was still alive: this hook is registered before LongStraw's, so atexit runs it after them."""

import atexit
import sys

import torch.distributed as dist


def _report() -> None:
    print(f"process group alive at exit: {dist.is_initialized()}", flush=True)


atexit.register(_report)

from longstraw.cli import main  # noqa: E402 - after the hook: LongStraw's exit hooks must run before it

sys.exit(main(["train", *sys.argv[1:]]))
