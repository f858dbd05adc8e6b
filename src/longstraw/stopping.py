"""Ctrl-C and SIGTERM during training: stop between steps, never in the middle of an update.

While the trainer's state is between two consistent points (an optimizer step has begun but the step is not
finished, or a checkpoint is being written), a signal is held: the update and the bookkeeping of that step
finish, then `TrainingInterrupted` is raised and the trainer saves the completed step. Outside those regions it
is raised at once (nothing has changed the weights yet, so the last completed step is still in memory). A
second signal while one is held stops at once.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt):
    """Raised by the handler for SIGINT/SIGTERM; `signum` gives the exit status 128 + signum."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


class StopSignals:
    """Context manager installing the handlers (main thread only; elsewhere signals keep their defaults).

    `busy()` tells whether a signal must be held; `check()` raises a held signal, called once `busy()` is False.
    """

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
            print(f"\n{signal.Signals(signum).name}: {self.describe()} (send it again to stop at once)",
                  file=sys.stderr, flush=True)
            return
        raise TrainingInterrupted(signum)

    def check(self) -> None:
        if self.pending is not None:
            signum, self.pending = self.pending, None
            raise TrainingInterrupted(signum)
