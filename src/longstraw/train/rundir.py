"""The run directory: checked and locked before the model loads (`open_run_dir`, `prepare_run_dir`, `RunLock`),
compared with the checkpoint on resume (`check_resume_config`), repaired after a kill (`truncate_metrics`: steps
past the checkpoint are redone on resume, and a half-written last line is dropped, so every step appears once).

`RunLock`: one writer per run directory, an exclusive `flock` on run_dir/.longstraw.lock taken before anything is
deleted or repaired; a second process is refused at once with the holder's PID and host (written into the file). The
kernel releases the lock when its holder dies however it dies, so a dead process's lock is taken over, with a note."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import socket
import sys
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longstraw.train.checkpoints import FILENAME, load_checkpoint, tmp_path_of

if TYPE_CHECKING:
    from longstraw.train.config import TrainConfig

# Files and folders a run writes; `--overwrite` deletes exactly these.
RUN_OUTPUTS = (FILENAME, FILENAME + ".tmp", "metrics.jsonl", "metrics.jsonl.tmp", "summary.json", "summary.json.tmp",
               "progress.png", "tb")
LOCK_FILE = ".longstraw.lock"  # not a run output: --overwrite keeps it, its presence is not "a run"
# Fields that do not change the trained model: never compared.
IGNORED_FIELDS = ("run_dir", "resume", "overwrite", "force", "stop_after", "save_every", "eval_prompts",
                  "tensorboard", "plot", "save_weights_only", "bias_every")
# Fields that change how a step is computed (float rounding only) or how long the run is: a note on resume.
NOTED_FIELDS = ("steps", "device", "chunk_size", "micro_batch", "checkpoint_layers", "offload_state", "cp", "tp")
# Every other field (model, dtype, task, data, reward_fn, loss, group_size, lr, seed, ...) changes what is trained:
# refused on resume unless --force. Unknown future fields fall in this group, the safe side.


class RunLock:
    """An exclusive lock on a run directory, from `acquire` to `release` (or this process's end: the kernel drops an
    flock with its last file descriptor). One per directory and process: re-acquiring returns the same lock."""

    _held: weakref.WeakValueDictionary[str, RunLock] = weakref.WeakValueDictionary()

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self.fd = path, fd  # fd None: a filesystem without locks (noted when acquired)
        self.pid = os.getpid()  # a forked child's copy must not clear the holder's line

    @classmethod
    def acquire(cls, run_dir: Path, what: str = "run_dir", option: str = "--run-dir") -> RunLock:
        """Lock `run_dir` (it exists) or raise ValueError naming the process that holds it; `what` names the
        directory in messages, `option` the command-line option that chooses another."""
        key = str(run_dir.resolve())
        held = cls._held.get(key)
        if held is not None and held.fd is not None and held.pid == os.getpid():
            return held
        path = run_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ValueError(f"{what} {run_dir}: cannot create its lock file {LOCK_FILE} ({err.strerror or err}): fix "
                             f"its permissions or choose another {option}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read_holder(fd)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                who = f"PID {holder[0]} on host {holder[1]}, since {holder[2]}" if holder else "a process starting up"
                kill = f" (kill {holder[0]})" if holder and holder[1] == socket.gethostname() else ""
                raise ValueError(f"{what} {run_dir} is in use by another longstraw process ({who}): wait for it to "
                                 f"end or stop it{kill}, or choose another {option}") from None
            print(f"note: {what} {run_dir}: its filesystem cannot lock files ({err.strerror or err}); a second "
                  "process writing to it at the same time will not be detected", file=sys.stderr)
            return cls(run_dir, None)
        previous = _read_holder(fd)
        if previous is not None and int(previous[0]) != os.getpid():
            print(f"note: {what} {run_dir}: taking over the lock of PID {previous[0]} on host {previous[1]} (since "
                  f"{previous[2]}), which ended without releasing it", file=sys.stderr)
        stamp = f"{os.getpid()} {socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, stamp, 0)
        lock = cls(run_dir, fd)
        cls._held[key] = lock
        return lock

    def release(self) -> None:
        """Clear the holder's line (an empty file means released cleanly) and unlock; idempotent."""
        fd, self.fd = self.fd, None
        if fd is None:
            return
        if os.getpid() == self.pid:
            with contextlib.suppress(OSError):  # best effort: the next holder then only prints a note
                os.ftruncate(fd, 0)
        os.close(fd)  # closing the last descriptor releases the flock

    def __del__(self) -> None:
        self.release()


def _read_holder(fd: int) -> tuple[str, str, str] | None:
    """(PID, host, start time) written by the lock's holder, or None for an empty or unreadable file."""
    try:
        fields = os.pread(fd, 512, 0).decode("utf-8", "replace").split()
    except OSError:
        return None
    if len(fields) != 3 or not fields[0].isdigit():
        return None
    return fields[0], fields[1], fields[2]


def check_not_in_use(run_dir: str | Path) -> None:
    """Raise the ValueError `RunLock.acquire` would if another process holds `run_dir`'s lock; creates nothing (the
    `--nproc` launcher's early check: rank 0 takes the lock itself)."""
    path = Path(run_dir)
    if (path / LOCK_FILE).is_file():
        RunLock.acquire(path).release()


def open_run_dir(run_dir: Path, cfg: TrainConfig) -> tuple[RunLock, dict[str, Any] | None]:
    """Check, create and lock the run directory; with cfg.run.resume, read and check its checkpoint (before any model is
    loaded) and return it, after printing the notes on changed settings. The caller releases the lock."""
    lock = prepare_run_dir(run_dir, cfg.run.resume, cfg.run.overwrite)
    if not cfg.run.resume:
        return lock, None
    try:
        ckpt = load_checkpoint(run_dir)
        metrics_lines(run_dir / "metrics.jsonl")  # an undecodable file refused here, before any model is loaded
        note_damaged_summary(run_dir / "summary.json")
        for note in check_resume_config(ckpt["config"], cfg.to_flat(), cfg.run.force, str(run_dir / FILENAME)):
            print(note, file=sys.stderr)
    except BaseException:
        lock.release()
        raise
    return lock, ckpt


def prepare_run_dir(run_dir: str | Path, resume: bool, overwrite: bool) -> RunLock:
    """Check, create and lock the run directory (before any model is loaded): refuse a path that is a file or cannot
    be created or written (a probe file), and a directory already holding a run unless `resume` (continue it) or
    `overwrite` (delete LongStraw's files in it); remove a temporary checkpoint a killed process left behind. Returns
    the lock, held until its `release` (or this process's end)."""
    path = Path(run_dir)
    if resume and overwrite:
        raise ValueError("--resume continues the run in run_dir and --overwrite deletes it: give only one")
    if path.exists() and not path.is_dir():
        raise ValueError(f"run_dir {path} is a file, not a directory: choose another --run-dir")
    if resume and not path.is_dir():
        raise FileNotFoundError(f"no checkpoint to resume from: {path / FILENAME} does not exist (run without "
                                "--resume)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"cannot create run_dir {path}: {err.strerror or err}; choose another --run-dir") from None
    probe = path / f".longstraw-write-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"run_dir {path} is not writable ({err.strerror or err}): fix its permissions or choose "
                         "another --run-dir") from None
    lock = RunLock.acquire(path)  # before anything in the directory is read, deleted or repaired
    try:
        ours = [name for name in RUN_OUTPUTS if (path / name).exists()]
        if resume and not (path / FILENAME).is_file():
            fix = (f"the run stopped before its first checkpoint ({', '.join(ours)} left): start over with "
                   "--overwrite instead of --resume") if ours else "run without --resume"
            raise FileNotFoundError(f"no checkpoint to resume from: {path / FILENAME} does not exist ({fix})")
        if not resume and ours:
            if not overwrite:
                raise ValueError(f"run_dir {path} already holds a run ({', '.join(ours)}): add --resume to continue "
                                 "it, --overwrite to delete it and start over, or choose another --run-dir")
            for name in ours:
                target = path / name
                if target.is_dir():
                    shutil.rmtree(target)
                else:
                    target.unlink()
        tmp_path_of(path).unlink(missing_ok=True)  # left by a process killed while writing a checkpoint
    except BaseException:
        lock.release()
        raise
    return lock


def check_resume_config(saved: dict[str, Any], current: dict[str, Any], force: bool, where: str) -> list[str]:
    """Compare a checkpoint's config with this run's; raise ValueError for a refused change: another model, or a
    field that changes what is trained, unless `force`. Returns the notes to print (fields that only change how it is
    computed or how long it runs, and forced ones). `where` names the checkpoint in messages."""
    def changed(names: list[str]) -> list[str]:
        return [f"{k}: {saved[k]!r} -> {current[k]!r}" for k in names]

    # A jsonl file's held-out rows (`eval_prompts`, data.split_rows) are never trained on: the count changes which are.
    ignored = [k for k in IGNORED_FIELDS if not (k == "eval_prompts" and current.get("task") == "jsonl")]
    common = [k for k in current if k in saved and saved[k] != current[k] and k not in ignored]
    noted = [k for k in common if k in NOTED_FIELDS]
    refused = [k for k in common if k not in NOTED_FIELDS]
    notes = []
    if "model" in refused and not force:
        raise ValueError(f"checkpoint {where} was trained from model {saved['model']!r}, not {current['model']!r}: "
                         "resume with the same --model (add --force only if it is the same model under another name "
                         "or path)")
    if refused and not force:
        raise ValueError(f"resuming {where} with settings that change what is trained: {'; '.join(changed(refused))}. "
                         "Use the checkpoint's values, or add --force to continue with the new ones")
    if refused:
        notes.append(f"--force: continuing with changed settings: {'; '.join(changed(refused))}")
    if noted:
        notes.append(f"note: resuming with changed settings: {'; '.join(changed(noted))}")
    return notes


def metrics_lines(path: Path) -> list[str]:
    """The lines of a metrics.jsonl (none when it does not exist); ValueError naming the file and line of bytes that
    are not UTF-8 (the trainer writes ASCII JSON, so such bytes are damage, not a row cut short by a kill)."""
    if not path.is_file():
        return []
    lines = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(f"{path}:{number}: not UTF-8 (byte 0x{raw[err.start]:02x}): the trainer writes one JSON "
                             "row per step; delete or fix that line, or start over with --overwrite") from None
    return lines


def truncate_metrics(path: Path, step: int) -> int:
    """Keep the rows of steps 1..step (the first of each) and drop the rest; returns how many rows were dropped."""
    if not path.is_file():
        return 0
    kept, dropped, seen = [], 0, set()
    for line in metrics_lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            s = int(row["step"])
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill
            dropped += 1
            continue
        if s > step or s in seen:
            dropped += 1
            continue
        seen.add(s)
        kept.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


def last_metrics_step(path: Path) -> int | None:
    """The step of metrics.jsonl's last whole row (None: no such row)."""
    for line in reversed(metrics_lines(path)):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


SUMMARY_FIX = ("`longstraw train --resume` with the run's options writes it again from its checkpoint (after a last "
               "held-out evaluation)")


def read_summary(path: Path, fix: str = SUMMARY_FIX) -> dict[str, Any]:
    """A run's summary.json; ValueError naming the file, in one line ending with `fix`, unless an intact JSON object."""
    raw = path.read_bytes()
    try:
        summary = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        why = str(err).splitlines()[0] if raw.strip() else "it is empty"
        raise ValueError(f"{path} is cut short or damaged, not a whole summary ({why}): {fix}") from None
    if not isinstance(summary, dict):
        raise ValueError(f"{path} is not a run's summary (a JSON {type(summary).__name__}, not an object): {fix}")
    return summary


def note_damaged_summary(path: Path) -> None:
    """On resume: one line naming a summary.json that does not read back (this run writes it again at its end)."""
    if path.is_file():
        try:
            read_summary(path, "this run writes it again when it ends")
        except ValueError as err:
            print(f"note: {err}", file=sys.stderr)
