"""Training checkpoints: one file, written atomically (temporary file, fsync, rename), read without running code.

It holds the model and optimizer/scheduler states, every RNG state, the data position and the config, so `--resume`
continues exactly where the run stopped (tests check 6 steps == 3 + resume + 3). Read with `torch.load(...,
weights_only=True)`: only tensors and plain values are unpickled, so a checkpoint cannot execute code. `integrity`
holds a SHA-256 over every value (each tensor's dtype, shape and bytes; every other value's type and repr),
recomputed on read, so flipped bytes inside tensor data (which torch.load does not notice) are refused by name.

`save_run`, `restore_run`: a run's state in and out of that file; in a distributed run the sharded state is gathered
to rank 0, which writes, and rank 0's checkpoint is broadcast and loaded into every rank's shards."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, cast

import torch

if TYPE_CHECKING:
    from longstraw.distributed.runtime import Parallel
    from longstraw.train.config import TrainConfig

FILENAME = "checkpoint.pt"
FORMAT = 2
# Entries every checkpoint has; `optimizer` is None in a weights-only checkpoint (--save-weights-only).
REQUIRED = ("step", "model", "optimizer", "scheduler", "config", "rng", "summary")
# Test hook (fault injection): sleep this many seconds in the middle of writing the temporary file, so a test
# can kill the process while a checkpoint is half written. Unset in normal use.
FAULT_SLEEP_ENV = "LONGSTRAW_FAULT_CHECKPOINT_SLEEP_S"


def tmp_path_of(run_dir: str | Path) -> Path:
    return Path(run_dir) / (FILENAME + ".tmp")


class WriteError(ValueError):
    """A run file could not be written (a full disk, a lost mount): the message names the file, the OS error by its
    code (ENOSPC) and what the run directory still holds."""


class CheckpointWriteError(WriteError):
    """The checkpoint could not be written; the previous one, if any, is intact (the message says which)."""


def write_error(path: Path, err: OSError, after: str = "", kind: type[WriteError] = WriteError) -> WriteError:
    """The one-line error for an OSError met writing `path`: its errno's name (ENOSPC), its text, then `after`."""
    code = errno.errorcode.get(err.errno, "") if err.errno is not None else ""
    what = f"{code} ({err.strerror})" if code and err.strerror else code or str(err) or type(err).__name__
    hint = "; free some space" if err.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    return kind(f"cannot write {path}: {what}{hint}{'; ' + after if after else ''}")


class _Writer:
    """File wrapper for torch.save: keeps the first OSError a write raised (torch reports it as a RuntimeError that
    loses it: "unexpected pos"), and, for the fault hook, after the first 64 KiB flushes and sleeps once."""

    def __init__(self, f: BinaryIO, sleep_s: float) -> None:
        self.f, self.sleep_s, self.written = f, sleep_s, 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        n = self._keeping_error(lambda: self.f.write(data))
        self.written += n
        if self.sleep_s and self.written >= 65536:
            self.f.flush()
            time.sleep(self.sleep_s)
            self.sleep_s = 0.0
        return n

    def flush(self) -> None:
        self._keeping_error(self.f.flush)

    def _keeping_error(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except OSError as err:
            self.error = self.error or err
            raise


def save_checkpoint(run_dir: str | Path, payload: dict[str, Any]) -> Path:
    """Write run_dir/checkpoint.pt atomically; a crash mid-write leaves the previous checkpoint intact. `payload`
    should carry `rng` (the RNG states at the step boundary it describes); without it, the current states are stored."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    final = run_dir / FILENAME
    tmp = tmp_path_of(run_dir)
    data = dict(payload, format=FORMAT)
    data.setdefault("rng", rng_state())
    data["integrity"] = {"sha256": digest(data)}
    sleep_s = float(os.environ.get(FAULT_SLEEP_ENV, "0") or 0)
    writer: _Writer | None = None
    try:
        with open(tmp, "wb") as f:
            writer = _Writer(f, sleep_s)
            torch.save(data, cast(BinaryIO, writer))  # cast: torch.save only calls write and flush
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except (OSError, RuntimeError) as err:
        oserror = writer.error if writer is not None and writer.error is not None else err
        if not isinstance(oserror, OSError):
            raise
        tmp.unlink(missing_ok=True)  # a partial file would only take the space a retry needs
        kept = (f"the previous checkpoint {final} is intact" if final.is_file() else
                "no checkpoint was written before this one")
        raise write_error(final, oserror, kept, CheckpointWriteError) from None
    _fsync_dir(run_dir)  # the rename itself survives a power loss
    return final


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems do not support fsync on directories
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(run_dir: str | Path) -> dict[str, Any]:
    """Read and verify run_dir/checkpoint.pt (no side effects: restore RNG states with `set_rng_state`). Clear errors,
    each naming the file, for: a missing file (FileNotFoundError), a damaged or truncated file, a file that is not a
    LongStraw checkpoint, a missing entry, and contents that fail the checksum (ValueError)."""
    path = Path(run_dir) / FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint to resume from: {path} does not exist (run without --resume)")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for truncated/corrupt/unsafe files
        raise ValueError(f"checkpoint {path} is damaged or truncated, or holds objects other than tensors and plain "
                         f"values ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); delete it to "
                         "start over, or restore a good copy") from None
    if not isinstance(data, dict) or data.get("format") not in (1, FORMAT):
        raise ValueError(f"checkpoint {path} is not a LongStraw checkpoint of format {FORMAT}")
    missing = [k for k in REQUIRED if k not in data and not (k == "summary" and data["format"] == 1)]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {', '.join(repr(k) for k in missing)}: it is incomplete or was "
                         "written by another program; delete it to start over, or restore a good copy")
    if data["format"] == 1:  # written before checksums existed (still read without running code)
        warnings.warn(f"checkpoint {path} predates checksums (format 1): its contents cannot be verified", stacklevel=2)
        return data
    stored = data.pop("integrity", None)
    if not isinstance(stored, Mapping) or "sha256" not in stored:
        raise ValueError(f"checkpoint {path} lacks its checksum ('integrity'): it is incomplete or was altered")
    if digest(data) != stored["sha256"]:
        raise ValueError(f"checkpoint {path} is corrupted: its contents do not match the SHA-256 recorded when it was "
                         "written (flipped bytes on disk or in transfer); delete it to start over, or restore a good "
                         "copy")
    return data


# ---------------------------------------------------------------------------------------------------- a run's state
def save_run(par: Parallel, run_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler, cfg: TrainConfig, step: int, summary: dict[str, Any],
             rng: dict[str, Any] | None) -> None:
    """Checkpoint a run at a step boundary (every rank calls: a sharded state is gathered to rank 0, which
    writes). rng: the RNG states at that boundary (None: the current ones); no optimizer with save_weights_only."""
    state = par.full_state(model, optimizer)
    if state is not None:  # rank 0
        save_checkpoint(run_dir, {
            "step": step, "model": state[0], "optimizer": None if cfg.run.save_weights_only else state[1],
            "scheduler": scheduler.state_dict(), "config": cfg.to_flat(), "summary": summary,
            "rng": rng if rng is not None else rng_state()})


def restore_run(par: Parallel, ckpt: dict[str, Any] | None, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler,
                run_dir: Path) -> tuple[int, dict[str, Any]]:
    """Load a checkpoint (read and checked by rank 0; None on the other ranks) into every rank's model,
    optimizer and scheduler, and restore rank 0's RNG states; returns (step, summary)."""
    meta = None
    if ckpt is not None:
        meta = {"scheduler": ckpt["scheduler"], "step": ckpt["step"], "summary": ckpt.get("summary", {}),
                "has_optimizer": ckpt["optimizer"] is not None}
    meta = par.broadcast(meta)
    par.load_full_state(model, optimizer if meta["has_optimizer"] else None, ckpt and ckpt["model"],
                        ckpt and ckpt["optimizer"])
    scheduler.load_state_dict(meta["scheduler"])
    step = int(meta["step"])
    if ckpt is not None:
        set_rng_state(ckpt["rng"])
        if not meta["has_optimizer"]:
            print(f"{run_dir / FILENAME} holds weights only (save_weights_only): the optimizer state "
                  f"restarts from zero at step {step}, so this run differs from an uninterrupted one",
                  file=sys.stderr)
    return step, dict(meta["summary"])


def check_same_shapes(model: torch.nn.Module, saved: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint of another architecture before load_state_dict raises a size-mismatch traceback."""
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in saved.items()}
    missing, extra = sorted(set(own) - set(theirs)), sorted(set(theirs) - set(own))
    differ = [k for k in own if k in theirs and own[k] != theirs[k]]
    if missing or extra or differ:
        detail = [f"{len(differ)} tensor(s) of another shape (e.g. {differ[0]}: {theirs[differ[0]]} in the "
                  f"checkpoint, {own[differ[0]]} here)"] if differ else []
        detail += [f"{len(missing)} missing (e.g. {missing[0]})"] if missing else []
        detail += [f"{len(extra)} unknown (e.g. {extra[0]})"] if extra else []
        raise ValueError(f"checkpoint {path} holds another model than this run's: {'; '.join(detail)}. Resume "
                         "with the model it was trained from")


# ---------------------------------------------------------------------------------------------------- checksum
def digest(value: Any) -> str:
    """SHA-256 of a payload: dicts by sorted key, sequences in order, tensors by dtype, shape and bytes."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(value.shape)}:".encode())
        h.update(t.view(torch.uint8).numpy().data)  # the raw bytes; no float conversion
    elif isinstance(value, Mapping):
        items = sorted(value.items(), key=lambda kv: (type(kv[0]).__name__, str(kv[0])))
        h.update(f"D{len(items)}:".encode())
        for k, v in items:
            _feed(h, k)
            _feed(h, v)
    elif isinstance(value, (list, tuple)):  # one code for both: only the contents matter
        h.update(f"L{len(value)}:".encode())
        for v in value:
            _feed(h, v)
    else:
        h.update(f"{type(value).__name__}:{value!r};".encode())


# ---------------------------------------------------------------------------------------------------- RNG states
def rng_state() -> dict[str, Any]:
    """Every RNG state as tensors and plain values (loadable with weights_only=True)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
