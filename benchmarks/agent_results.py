"""The agent demo's results (`make demo-agent`): one file and one plot from the runs of a warm start + GRPO.

    python -m benchmarks agent-results OUT RUN_DIR [RUN_DIR ...] [--wall-s S]

reads each run's summary.json and metrics.jsonl (`longstraw train` with --warm-start-steps on an agent task) and
writes OUT/agent-results.json (per run: the held-out greedy reward and tool-call rate before, after the warm start and
after GRPO, the warm start's nll per step, GRPO's sampled reward and tool calls per step; the host's load average now)
and OUT/agent-results.png (the held-out reward and tool-call rate at the three points, one line per run; GRPO's
sampled reward per step). A run without the three evaluations is refused by name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from benchmarks.registry import Benchmark

POINTS = ("before", "after_warm_start", "after")
_REWARD = {"before": "eval_before", "after_warm_start": "eval_after_warm_start", "after": "eval_after"}


def run_results(run_dir: Path) -> dict[str, Any]:
    """One run's record; ValueError naming the run when it lacks the three held-out evaluations."""
    from longstraw.train.reporting import read_metrics  # here: --help imports no torch
    from longstraw.train.rundir import read_summary

    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise ValueError(f"{run_dir} holds no summary.json: run `longstraw train` with --warm-start-steps to the end "
                         "first")
    summary = read_summary(summary_path)
    missing = [key for p in POINTS for key in (_REWARD[p], f"tool_call_rate_{p}") if key not in summary]
    if missing:
        raise ValueError(f"{summary_path} lacks {', '.join(missing)}: it is not a finished run of an agent task with "
                         "a warm start (--warm-start-steps) and held-out prompts (--eval-prompts)")
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "step" in r]
    return {
        "run_dir": str(run_dir),
        "held_out_reward": {p: summary[_REWARD[p]] for p in POINTS},
        "held_out_tool_call_rate": {p: summary[f"tool_call_rate_{p}"] for p in POINTS},
        "warm_start": summary["warm_start"],
        "grpo_steps": summary.get("steps"),
        "grpo_sampled_reward": [r["reward_mean"] for r in rows],
        "grpo_tool_calls_mean": [r.get("tool_calls_mean") for r in rows],
        "grpo_seconds": round(sum(float(r.get("time_step_s", r.get("time_rollout_s", 0.0) + r.get("time_train_s",
                                                                                                  0.0)))
                                  for r in rows), 1),
    }


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    """The plot; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    labels = ["before", "after warm start", "after GRPO"]
    for r in results:
        name = Path(r["run_dir"]).name
        axes[0].plot(labels, [r["held_out_reward"][p] for p in POINTS], marker="o", label=name)
        axes[1].plot(labels, [r["held_out_tool_call_rate"][p] for p in POINTS], marker="o", label=name)
        axes[2].plot(range(1, len(r["grpo_sampled_reward"]) + 1), r["grpo_sampled_reward"], label=name)
    axes[0].set_title("held-out greedy reward")
    axes[1].set_title("held-out tool-call rate")
    axes[1].set_ylim(-0.05, 1.05)
    axes[2].set_title("GRPO: sampled reward per step")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="directory for agent-results.json and agent-results.png")
    parser.add_argument("runs", nargs="+", help="run directories (longstraw train --warm-start-steps ...)")
    parser.add_argument("--wall-s", type=float, default=None, help="the whole demo's wall time, recorded as given")


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of `python -m benchmarks agent-results`: status 2 (nothing written) when a run is refused."""
    try:
        results = [run_results(Path(r)) for r in args.runs]
    except ValueError as err:
        print(f"agent-results: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"runs": results, "wall_s": args.wall_s, "load_average_at_end": list(os.getloadavg()),
              "cpus": os.cpu_count()}
    (out / "agent-results.json").write_text(json.dumps(record, indent=2) + "\n")
    for r in results:
        reward, rate = r["held_out_reward"], r["held_out_tool_call_rate"]
        print(f"{r['run_dir']}: held-out reward {reward['before']:.3f} -> {reward['after_warm_start']:.3f} (warm "
              f"start) -> {reward['after']:.3f} (GRPO); tool-call rate {rate['before']:.2f} -> "
              f"{rate['after_warm_start']:.2f} -> {rate['after']:.2f}")
    written = ["agent-results.json"] + (["agent-results.png"] if plot(results, out / "agent-results.png") else [])
    print(f"outputs in {out}: {', '.join(written)}")
    return 0


BENCHMARKS = (
    Benchmark(
        name="agent-results", help="the agent demo's results file and plot from its runs (make demo-agent)",
        description=__doc__.split("\n\n")[0],
        add_arguments=add_arguments, run=run_from_args,
    ),
)
