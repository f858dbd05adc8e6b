"""One row of `python -m benchmarks tree` in a fresh process: `python -m benchmarks.tree_worker '<json config>'`.

Builds the model (`load_bench_model`, seed 0) and the synthetic batch (`tree_batch.make_trajectories` with the
config's seed: the same tokens and advantages for every row), then measures steps — the batch's loss forward and
backward, gradients accumulated into `.grad` from None, no optimizer step — as `benchmarks/worker.py` measures
`backward_group` (peak: VmHWM above VmRSS just before the step, the high-water mark reset first; wall and CPU time;
CPU pressure). The first step is cold: its peak is the row's `peak_bytes` (what every bench and the planner
measure: it includes the process's one-time runtime allocations). `warm_steps` more follow, each after
`zero_grad(set_to_none=True)`: the fastest one's times are the row's `time_s`, `cpu_time_s` and `cpu_pressure` (a
training run's steady state, without the first call's one-time costs, which differ between rows; the fastest of
several, the least disturbed by other processes); the first step's are kept under `first_step`, every warm step's
wall time as `warm_times_s`, the last one's peak as `warm_peak_bytes`. Rows (`planner.tree.ROWS`):

* flattened: `tree_baselines.flattened_step` (every trajectory a full sequence, one at a time);
* group: `backward_group` per task (plan exact), the task's S + C tokens as the prompt;
* packed: `tree_baselines.packed_step` (one sequence, an ancestor mask);
* tree_exact / tree_detach: `backward_tree` with plan exact / detach.

Prints one JSON line; a failure exits non-zero with its traceback on stderr, which the parent records.
"""

from __future__ import annotations

import gc
import json
import sys
from typing import Any

from benchmarks.common import load_bench_model
from benchmarks.launch import worker_args
from benchmarks.peers_worker import _Meter
from benchmarks.tree_baselines import flattened_step, pack_tree, packed_step
from benchmarks.tree_batch import make_trajectories, task_groups
from longstraw.planner.tree import ROWS, TreeShape

CONFIG_KEYS = ("row", "model", "dtype", "device", "shape", "chunk_size", "micro_batch", "seed")


def run_row(config: dict[str, Any]) -> dict[str, Any]:
    """Build the model and batch, run the row's measured step, return the measurement."""
    missing = [k for k in CONFIG_KEYS if k not in config]
    if missing:
        raise ValueError(f"tree worker config is missing {', '.join(missing)}")
    row = str(config["row"])
    if row not in ROWS:
        raise ValueError(f"unknown row {row!r}: one of {', '.join(ROWS)}")
    device = str(config["device"])
    shape = TreeShape(**config["shape"])
    model = load_bench_model(str(config["model"]), str(config["dtype"]), device)
    trajectories = make_trajectories(shape, model.config.vocab_size, int(config["seed"]))
    chunk, k = int(config["chunk_size"]), int(config["micro_batch"])
    packed = pack_tree(trajectories) if row == "packed" else None
    groups = task_groups(trajectories) if row == "group" else None
    stats: dict[str, Any] = {}

    def step() -> float:
        if row == "flattened":
            return flattened_step(model, trajectories)
        elif row == "packed":
            return packed_step(model, trajectories, packed=packed)
        elif row == "group":
            from longstraw import backward_group

            assert groups is not None
            return sum(backward_group(model, group, plan="exact", chunk_size=chunk, micro_batch=k).loss
                       for group in groups)
        from longstraw.api.tree import backward_tree

        result = backward_tree(model, trajectories, plan=row.removeprefix("tree_"), chunk_size=chunk, micro_batch=k)
        stats.update(result.stats)
        return result.loss

    # The first step is measured cold, as every bench measures a step (its peak includes the process's one-time
    # runtime allocations, which the planner counts); the warm steps after it give the steady-state time.
    steps = []
    for i in range(1 + int(config.get("warm_steps", 0))):
        if i:
            model.zero_grad(set_to_none=True)  # each step allocates its gradients, as the first one does
        meter = _Meter(device)
        meter.start()
        loss = step()
        steps.append({**meter.stop(), "loss": loss})
    first, fastest = steps[0], min(steps[1:] or steps, key=lambda m: m["time_s"])
    timing = {key: fastest[key] for key in ("time_s", "cpu_time_s", "cpu_pressure")}
    return {**first, **timing, "first_step": {key: first[key] for key in ("time_s", "cpu_time_s", "cpu_pressure")},
            "warm_steps": len(steps) - 1, "warm_times_s": [m["time_s"] for m in steps[1:]],
            "warm_peak_bytes": steps[-1]["peak_bytes"] if len(steps) > 1 else None, "stats": stats}


def main(argv: list[str] | None = None) -> int:
    args = worker_args(argv, "python -m benchmarks.tree_worker '<json config>'", 1)
    if args is None:
        return 2
    measurement = run_row(json.loads(args[0]))
    print(json.dumps(measurement), flush=True)
    gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
