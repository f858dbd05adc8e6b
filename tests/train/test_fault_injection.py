"""Fault injection: training processes SIGKILLed at random points, then resumed, end bit-identical to a straight run.

Each trial starts a fresh run (checkpoint every step) in a child process and kills it with SIGKILL at a random
point: after a random number of completed steps plus a random delay (landing between a step's metrics row and
its checkpoint, inside the next step, or inside a checkpoint write), and in every third trial while a checkpoint
is being written (a test hook sleeps halfway through the write). Every time: the checkpoint on disk loads and
passes its checksum, a resume finishes the run, the stale temporary file is gone, metrics.jsonl holds each step
once with the straight run's values, and the final weights are torch.equal to the straight run's.

The counts go to stdout and to fault_injection.json under the test's tmp dir (for the reliability table in
docs/usage.md). Children are forked from a server that has already imported torch (`train_child`): ~25 process
starts would otherwise cost ~5 s each.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import time
from pathlib import Path

import torch
import train_child
from helpers import jsonl_dataset

from longstraw.train.checkpoints import FAULT_SLEEP_ENV, load_checkpoint, tmp_path_of

STEPS = 8
KILLS = 12
MAX_TRIALS = 20  # a trial whose process finishes before the kill does not count; stop trying after this many


def _common(data: Path) -> list[str]:
    return ["train", "--model", "tiny-llama", "--task", "jsonl", "--data", str(data),
            "--reward-fn", "rewards_for_tests:even_byte_fraction", "--group-size", "3", "--max-new-tokens", "4",
            "--lr", "1e-3", "--eval-prompts", "0", "--no-plot", "--chunk-size", "8", "--steps", str(STEPS),
            "--save-every", "1"]


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _wait(cond, proc, timeout_s: float = 120.0) -> bool:
    """Poll `cond` every 2 ms while `proc` lives; True once it holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        if not proc.is_alive():
            return False
        time.sleep(0.002)
    raise TimeoutError("the training child made no progress in time")


def test_sigkill_at_random_points_then_resume_is_bit_identical(tmp_path):
    data = jsonl_dataset(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()

    def start(run: Path, *extra: str, env: dict[str, str] | None = None) -> multiprocessing.Process:
        return train_child.start([*_common(data), "--run-dir", str(run), *extra], logs / run.name, env)

    straight = tmp_path / "straight"
    proc = start(straight)
    proc.join()
    assert proc.exitcode == 0, (logs / "straight").read_text()
    want_rows = _rows(straight)
    want = load_checkpoint(straight)["model"]
    assert [r["step"] for r in want_rows] == list(range(1, STEPS + 1))
    assert sum(r["grad_norm"] > 0 for r in want_rows) >= 2  # the weights really move

    rng = random.Random(20261130)
    record = {"kills": 0, "kills_during_checkpoint_write": 0, "checkpoints_loaded": 0, "resumes": 0,
              "bit_identical": 0, "duplicate_metric_rows": 0, "stale_tmp_removed": 0, "finished_before_kill": 0,
              "metrics_ahead_of_checkpoint": 0,
              "killed_at_checkpoint_steps": []}
    for trial in range(MAX_TRIALS):
        if record["kills"] >= KILLS:
            break
        run = tmp_path / f"trial{trial}"
        in_write = trial % 3 == 2
        proc = start(run, env={FAULT_SLEEP_ENV: "0.3"} if in_write else None)
        ckpt, tmp = run / "checkpoint.pt", tmp_path_of(run)
        k = rng.randint(1, STEPS - 1)  # completed steps (rows in metrics.jsonl) before the kill
        alive = _wait(lambda k=k, run=run, ckpt=ckpt: len(_rows_safe(run)) >= k and ckpt.exists(), proc)
        if in_write:  # then the next checkpoint write begins; kill at a random moment inside it
            alive = alive and _wait(tmp.exists, proc)
            delay = rng.uniform(0.0, 0.25)
        else:
            delay = rng.uniform(0.0, 0.08)  # a step takes ~0.03 s on an idle core
        time.sleep(delay)
        if not alive or not proc.is_alive():
            proc.join()
            record["finished_before_kill"] += 1
            continue
        proc.kill()  # SIGKILL: no handler runs
        proc.join()
        if proc.exitcode != -9:  # it finished in the instant before the signal
            record["finished_before_kill"] += 1
            continue
        record["kills"] += 1
        had_tmp = tmp.exists()  # killed inside a checkpoint write
        record["kills_during_checkpoint_write"] += int(had_tmp)

        saved = load_checkpoint(run)  # loads, checksum verified
        record["checkpoints_loaded"] += 1
        record["killed_at_checkpoint_steps"].append(int(saved["step"]))
        record["metrics_ahead_of_checkpoint"] += int(len(_rows_safe(run)) > saved["step"])

        resumed = start(run, "--resume")
        resumed.join()
        log = (logs / run.name).read_text()
        assert resumed.exitcode == 0, log
        record["resumes"] += 1
        assert not tmp.exists(), "the stale temporary checkpoint survived the resume"
        record["stale_tmp_removed"] += int(had_tmp)
        rows = _rows(run)
        steps = [r["step"] for r in rows]
        record["duplicate_metric_rows"] += len(steps) - len(set(steps))
        assert steps == list(range(1, STEPS + 1)), (steps, log)
        for got, exp in zip(rows, want_rows):
            assert (got["loss"], got["reward_mean"], got["grad_norm"]) == (exp["loss"], exp["reward_mean"],
                                                                           exp["grad_norm"])
        final = load_checkpoint(run)["model"]
        assert final.keys() == want.keys()
        if all(torch.equal(final[k], want[k]) for k in want):
            record["bit_identical"] += 1

    print("fault injection:", json.dumps(record))
    (tmp_path / "fault_injection.json").write_text(json.dumps(record, indent=2) + "\n")
    assert record["kills"] >= KILLS, record
    assert record["kills_during_checkpoint_write"] >= 2, record
    assert record["checkpoints_loaded"] == record["resumes"] == record["bit_identical"] == record["kills"], record
    assert record["duplicate_metric_rows"] == 0


def _rows_safe(run: Path) -> list[str]:
    """Complete lines of metrics.jsonl (the writer may be mid-line)."""
    try:
        text = (run / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return []
    return [line for line in text.split("\n")[:-1] if line.strip()]
