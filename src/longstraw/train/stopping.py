"""Ctrl-C and SIGTERM during training: stop between steps, never in the middle of an update.

While the trainer's state is between two consistent points (an optimizer step has begun but the step is not
finished, or a checkpoint is being written), a signal is held: the step finishes, then `TrainingInterrupted` is
raised and the trainer saves the completed step. Outside those regions it is raised at once (nothing has changed the
weights yet). A second signal while one is held stops at once. `save_after_failure`: what the trainer then saves."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from longstraw.distributed.runtime import Parallel

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """Raised by the handler for SIGINT/SIGTERM; `signum` gives the exit status 128 + signum."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


class StopSignals:
    """Context manager installing the handlers (main thread only; elsewhere signals keep their defaults). `busy()` tells
    whether a signal must be held; `check()` raises a held signal, called once `busy()` is False."""

    def __init__(self, busy: Callable[[], bool], describe: Callable[[], str]) -> None:
        self.busy, self.describe = busy, describe
        self.pending: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.busy() and self.pending is None:
            self.pending = signum
            what = self.describe()  # empty: say nothing (the other ranks of a distributed run)
            if what:
                print(f"\n{signal.Signals(signum).name}: {what} (send it again to stop at once)", file=sys.stderr,
                      flush=True)
            return
        raise TrainingInterrupted(signum)

    def check(self) -> None:
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise TrainingInterrupted(signum)


def save_after_failure(save: Callable[[], None], path: Path, *, step: int, saved_step: int | None, steps_done: int,
                       dirty: bool, par: Parallel) -> None:
    """Checkpoint the last completed step (`step`, with `save`) unless it is already saved; one line on stderr
    saying where. Nothing new since the start (or the resumed checkpoint): nothing. `dirty` (an optimizer step of
    step + 1 had begun: the weights are neither step's) or a distributed run (a failed one cannot gather its
    state): not saved, and the line says why. path: the checkpoint file."""
    on_disk = f"the last checkpoint, step {saved_step}, is {path}" if saved_step is not None else \
        "no checkpoint was written"
    if steps_done == 0 and not dirty:
        return  # nothing new since the start (or the resumed checkpoint)
    if saved_step == step and not dirty:  # also a distributed stop: every rank saved it together
        line = f"the last completed step ({step}) is saved in {path}; continue with --resume"
    elif dirty or par.distributed:
        line = (f"step {step + 1} had already changed the weights when it failed, so it is not saved" if dirty else
                "a failed distributed run cannot gather its state") + f"; {on_disk}"
    else:  # one process (rank 0)
        try:
            save()
            line = f"saved the last completed step ({step}) to {path}; continue with --resume"
        except Exception as err:
            line = f"could not save step {step} ({type(err).__name__}: {err}); {on_disk}"
    if par.is_main:
        print(f"longstraw train: {line}", file=sys.stderr)

def warm_start_stopped(err: BaseException, run_dir: Path) -> str:
    """The line saying what a warm start that ended with `err` (a signal or an error) left: nothing, since its weights
    are no step boundary and a fresh run has no checkpoint before its first step."""
    how = f"stopped by {signal.Signals(err.signum).name}" if isinstance(err, TrainingInterrupted) else "failed"
    return (f"longstraw train: the warm start {how} before its end; nothing is saved (its weights are no step "
            f"boundary, and {run_dir} holds no checkpoint yet): start the run again with --overwrite")
