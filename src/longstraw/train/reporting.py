"""What a training run reports: each step's metrics row (`StepLog`), the progress line (`Progress`), rank 0's
output files (`Report`: metrics.jsonl, TensorBoard, summary.json, progress.png) and plots. `pyplot` and `save_figure`
are the one way every LongStraw plot is written (the benchmarks use them too)."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from longstraw.peak import PeakMemory
from longstraw.planner import GIB
from longstraw.train.checkpoints import FILENAME, write_error
from longstraw.train.rundir import last_metrics_step, truncate_metrics

if TYPE_CHECKING:
    from longstraw.distributed.runtime import Parallel
    from longstraw.train.config import TrainConfig

PathLike = TypeVar("PathLike", str, Path)


class StepLog:
    """This rank's share of one step, counted while it runs; `row` gathers every rank's into the metrics row.
    Created when the step starts: the peak-memory meter and the clock start here."""

    def __init__(self, device: str) -> None:
        self.meter = PeakMemory(device)
        self.meter.start()
        self.t0 = self.t1 = time.perf_counter()
        self.rewards: list[torch.Tensor] = []
        self.dropped = self.response_tokens = self.prompt_tokens = self.observation_tokens = self.turns = 0
        self.tool_calls = 0
        self.trees: dict[str, int] = {}  # --rollout tree: the kept trees' shapes and rollout counts, summed

    def tree(self, stats: dict[str, int], rollout_stats: dict[str, int]) -> None:
        """One kept tree: its prefix tree's shape (`Tree.stats`) and its rollout's counts (`TreeRollout.stats`)."""
        _add_trees(self.trees, {key if key.startswith(("tree_", "rollout_")) else f"tree_{key}": value
                                for key, value in {**stats, **rollout_stats}.items()})

    def rollout(self, rewards: torch.Tensor, response_lengths: list[int], prompt_tokens: int, dropped: bool,
                observation_tokens: int = 0, turns: int | None = None, tool_calls: int = 0) -> None:
        """One sampled group: its rewards and response tokens count (and an agent task's observation tokens and
        model turns); its prompt only if the group is kept."""
        self.rewards.append(rewards)
        self.response_tokens += sum(response_lengths)
        self.observation_tokens += observation_tokens
        self.turns += len(response_lengths) if turns is None else turns
        self.tool_calls += tool_calls
        self.dropped += dropped
        self.prompt_tokens += 0 if dropped else prompt_tokens

    def rollouts_done(self) -> None:
        self.t1 = time.perf_counter()

    def row(self, par: Parallel, step: int, n_kept: int, skipped: int, loss: float, grad_norm: float, lr: float,
            bias_metrics: dict[str, float]) -> dict[str, Any]:
        """The step's metrics row (every rank calls: the shares are gathered). n_kept: kept groups over all ranks;
        skipped: this rank's kept groups whose gradient was exactly zero."""
        t2 = time.perf_counter() - bias_metrics.get("time_bias_s", 0.0)  # phase times and tok/s: the step's own
        ranks = par.gather({  # every rank's share of the step, in rank order (= prompt order)
            "rewards": torch.cat(self.rewards), "dropped": self.dropped, "response_tokens": self.response_tokens,
            "prompt_tokens": self.prompt_tokens, "peak": self.meter.peak_absolute_bytes(),
            "observation_tokens": self.observation_tokens, "turns": self.turns, "tool_calls": self.tool_calls,
            "t_rollout": self.t1 - self.t0, "t_train": t2 - self.t1, "t_step": t2 - self.t0, "skipped": skipped,
            "trees": self.trees,
        })
        peak = max(x["peak"] for x in ranks)
        ranks = ranks[:: par.block_size]  # the ranks of a block (context and tensor parallel) hold the same groups
        rewards = torch.cat([x["rewards"] for x in ranks])
        total = {key: sum(x[key] for x in ranks) for key in ("dropped", "response_tokens", "prompt_tokens", "skipped",
                                                             "observation_tokens", "turns", "tool_calls")}
        responses, t_step = max(1, rewards.numel()), [x["t_step"] for x in ranks]
        trees: dict[str, float] = {}  # summed over ranks (the depth: the deepest)
        for x in ranks:
            _add_trees(trees, x["trees"])
        if trees:
            # tokens the tree's passes encode (each shared token once) over those of every trajectory run on its own
            trees["tree_encoded_fraction"] = trees["tree_tokens_encoded"] / max(1, trees["tree_tokens_flattened"])
        return {
            "step": step + 1, "reward_mean": float(rewards.mean()), "reward_max": float(rewards.max()),
            "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
            "loss": loss, "grad_norm": grad_norm, "lr": lr,
            "kept_groups": n_kept // par.block_size,  # a block's ranks share their groups
            "skipped_zero_advantage": total["skipped"], "dropped_groups": total["dropped"],
            "response_tokens_mean": total["response_tokens"] / responses,
            # agent tasks: tokens the environment appended (in the responses, not in the loss), model turns and tool
            # calls; the step's totals over every sampled response, and per response
            **{key: total[key] for key in ("observation_tokens", "turns", "tool_calls")},
            **{f"{key}_mean": total[key] / responses for key in ("observation_tokens", "turns", "tool_calls")},
            "prompt_tokens": total["prompt_tokens"] // max(1, n_kept // par.block_size) if n_kept else 0,
            "peak_memory_bytes": peak,  # the largest rank's
            "tokens_per_s": (total["prompt_tokens"] + total["response_tokens"]) / max(1e-9, *t_step),
            "time_rollout_s": max(x["t_rollout"] for x in ranks), "time_train_s": max(x["t_train"] for x in ranks),
            # --rollout tree: the kept trees' counts (`StepLog.tree`: tree_* and rollout_*), tree_encoded_fraction
            **trees, **bias_metrics,
        }


def _add_trees(into: dict[str, Any], trees: dict[str, Any]) -> None:
    """Add one tree's (or rank's) counts into `into`: summed, but the depth is the deepest."""
    for key, value in trees.items():
        into[key] = max(into.get(key, 0), value) if key == "tree_depth" else into.get(key, 0) + value


class Progress:
    """One line per step on stdout; on a terminal, an in-place bar while the step runs."""

    def __init__(self, total_steps: int, enabled: bool = True) -> None:
        self.total = total_steps
        self.tty = sys.stdout.isatty()
        self.enabled = enabled  # only rank 0 prints

    def update(self, step: int, phase: str, done: int, of: int) -> None:
        if self.tty and self.enabled:
            filled = int(20 * done / max(1, of))  # of a 20-character bar
            bar = "#" * filled + "-" * (20 - filled)
            print(f"\rstep {step + 1}/{self.total} [{bar}] {phase} {done}/{of}   ", end="", flush=True)

    def step_done(self, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = (f"step {m['step']}/{self.total} | reward {m['reward_mean']:.3f} (max {m['reward_max']:.3f}) | "
                f"loss {m['loss']:+.2e} | gnorm {m['grad_norm']:.2f} | peak {m['peak_memory_bytes'] / GIB:.2f} GiB | "
                f"{m['tokens_per_s']:.0f} tok/s | rollout {m['time_rollout_s']:.1f}s train {m['time_train_s']:.1f}s")
        if "bias_cosine" in m:
            line += f" | bias: cos {m['bias_cosine']:.4f} rel err {m['bias_rel_error']:.3f}"
        if m["dropped_groups"]:
            line += f" | dropped {m['dropped_groups']} equal-reward group(s)"
        if m.get("skipped_zero_advantage"):
            line += f" | skipped {m['skipped_zero_advantage']} zero-advantage group(s) (no gradient)"
        print(("\r" if self.tty else "") + line + " " * 4, flush=True)


class Report:
    """Rank 0's outputs of a run; with `enabled` False (the other ranks) it writes and prints nothing.
    With cfg.run.tensorboard it needs the tensorboard package (a ValueError saying so, before training)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, enabled: bool) -> None:
        self.cfg, self.run_dir, self.enabled = cfg, run_dir, enabled
        self.metrics_path = run_dir / "metrics.jsonl"
        self.progress = Progress(cfg.optimizer.steps, enabled=enabled)
        self.writer = None
        if cfg.run.tensorboard and enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("--tensorboard needs the tensorboard package: "
                                 "pip install 'longstraw[tensorboard]' (or tensorboard)") from None
            self.writer = SummaryWriter(str(run_dir / "tb"))

    def note(self, text: str) -> None:
        """A line of the run's progress or results (stdout)."""
        if self.enabled:
            print(text, flush=True)

    def warn(self, text: str) -> None:
        """A warning (stderr)."""
        if self.enabled:
            print(text, file=sys.stderr, flush=True)

    def resumed(self, step: int) -> None:
        """Resumed at `step`: metrics rows past it are removed (those steps are redone)."""
        if self.enabled:
            dropped = truncate_metrics(self.metrics_path, step)
            extra = f" ({dropped} metrics row(s) after it removed)" if dropped else ""
            self.note(f"resumed from {self.run_dir / FILENAME} at step {step}{extra}")

    def eval_before(self, reward: float) -> None:
        if self.cfg.run.eval_prompts:
            self.note(f"held-out greedy reward before training: {reward:.3f} ({self.cfg.run.eval_prompts} prompts)")

    def write(self, m: dict[str, Any]) -> None:
        """Append the step's row to metrics.jsonl."""
        if self.enabled:
            try:
                with self.metrics_path.open("a") as f:
                    f.write(json.dumps(m) + "\n")
            except OSError as err:
                raise write_error(self.metrics_path, err, f"step {m['step']} is not recorded") from None

    def show(self, m: dict[str, Any]) -> None:
        """The step's TensorBoard scalars and its progress line."""
        if self.writer is not None:
            for key, value in m.items():
                if key != "step":
                    self.writer.add_scalar(key, value, m["step"])
        self.progress.step_done(m)

    def finish(self, summary: dict[str, Any]) -> None:
        """The end of a complete run: the evaluation line, summary.json, progress.png, the list of outputs."""
        if not self.enabled:
            return
        if self.cfg.run.eval_prompts:
            self.note(f"held-out greedy reward: before {summary.get('eval_before', float('nan')):.3f} -> "
                      f"after {summary['eval_after']:.3f}")
        # summary.json and metrics.jsonl describe the same run: rows past its last step (only another writer could
        # have left them; the run directory's lock refuses one) are removed, and a gap is said.
        truncate_metrics(self.metrics_path, int(summary["steps"]))
        last = last_metrics_step(self.metrics_path)
        if last != summary["steps"]:
            self.warn(f"note: {self.metrics_path} ends at step {last}, the run at step {summary['steps']}: rows are "
                      "missing")
        summary.update(run_totals(read_metrics(self.metrics_path)))
        checkpoint = self.run_dir / FILENAME
        if checkpoint.exists():
            summary["checkpoint_bytes"] = checkpoint.stat().st_size
            summary["checkpoint_holds"] = ("weights only (save_weights_only)" if self.cfg.run.save_weights_only else
                                           "weights + AdamW's two moments, about 3x the weights")
        self.note(totals_line(summary))
        write_summary(self.run_dir / "summary.json", summary)
        written = [self.metrics_path.name, "summary.json", FILENAME]
        if "checkpoint_bytes" in summary:
            written[-1] += f" ({size_text(summary['checkpoint_bytes'])}: {summary['checkpoint_holds']})"
        if self.cfg.run.plot and plot_metrics(self.metrics_path, self.run_dir / "progress.png"):
            written.append("progress.png")
        if self.writer is not None:
            self.writer.close()
        self.note(f"outputs in {self.run_dir}: {', '.join(written)}")


def run_totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The run's counts over its metrics rows, for summary.json: groups skipped for a zero advantage (their rewards
    all equal, so no gradient: GRPO's advantages are rewards minus the group mean), the steps that skipped one, the
    steps where no group gave a gradient at all (every kept group skipped, or every group dropped), dropped groups."""
    skipped = [int(r.get("skipped_zero_advantage", 0)) for r in rows]
    kept = [int(r.get("kept_groups", 0)) for r in rows]
    return {
        "steps_with_skipped_groups": sum(s > 0 for s in skipped),
        "skipped_zero_advantage_groups": sum(skipped),
        "steps_without_gradient": sum(k - s <= 0 for k, s in zip(kept, skipped)),
        "dropped_groups": sum(int(r.get("dropped_groups", 0)) for r in rows),
    }


def totals_line(summary: dict[str, Any]) -> str:
    """The end-of-run sentence on those counts (`run_totals`)."""
    steps = summary.get("steps", 0)
    text = (f"Of {steps} steps, {summary['steps_with_skipped_groups']} skipped a group whose rewards were all equal "
            f"and {summary['steps_without_gradient']} had no gradient at all")
    if summary["dropped_groups"]:
        text += f"; dynamic sampling dropped {summary['dropped_groups']} such group(s)"
    return text + "."


def size_text(n: int) -> str:
    """A file size for a person: GB (10^9) from 1 GB, else MB."""
    return f"{n / 1e9:.2f} GB" if n >= 10**9 else f"{n / 1e6:.1f} MB"


def strict_json(value: Any) -> Any:
    """`value` with every non-finite float (NaN, inf) replaced by None, in nested dicts, lists and tuples: what
    `json.dumps(allow_nan=False)` accepts, so that every JSON reader reads summary.json (NaN is no JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: strict_json(v) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """summary.json, strict JSON (a missing or non-finite number is null), written whole or not at all (temporary
    file, then rename); `WriteError` naming the file and the OS error (ENOSPC) if it cannot be written."""
    text = json.dumps(strict_json(summary), indent=2, allow_nan=False) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise write_error(path, err, f"the run's checkpoint {path.parent / FILENAME} and metrics.jsonl are "
                                     "complete") from None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; ValueError naming file and line of a row that is no JSON object (cut, damaged)."""
    rows = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"{path}:{lineno}: not a metrics row, the file is cut short or damaged "
                                 f"({type(err).__name__}: {str(err).splitlines()[0]})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: not a metrics row (a JSON {type(row).__name__}, not an object)")
            rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------- plots
def pyplot(what: str = "plot") -> Any:
    """matplotlib.pyplot on the Agg backend, or None with a note on stderr ("no <what> written") without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {what} written (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def save_figure(fig: Any, path: PathLike) -> PathLike:
    """Lay out, write (110 dpi) and close `fig`; returns `path`."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_metrics(metrics_path: Path, out: Path) -> Path | None:
    """Reward (mean and max) and peak memory per step, and the bias meter's numbers when the run has them, as a
    PNG. Skipped with a note without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    metered = [r for r in rows if "bias_cosine" in r]
    fig, axes = plt.subplots(1, 3 if metered else 2, figsize=(15 if metered else 10, 3.6))
    ax1, ax2 = axes[0], axes[1]
    means = [r["reward_mean"] for r in rows]
    window = 5  # one group per step is noisy: show the trend too
    trend = [sum(part) / len(part) for part in (means[max(0, i - window + 1) : i + 1] for i in range(len(means)))]
    ax1.plot(steps, means, marker="o", alpha=0.45, label="mean")
    ax1.plot(steps, trend, linewidth=2.2, label=f"mean, {window}-step average")
    ax1.plot(steps, [r["reward_max"] for r in rows], linestyle="--", alpha=0.6, label="max")
    ax1.set(xlabel="step", ylabel="reward", ylim=(-0.02, 1.02), title="sampled reward")
    ax1.legend(fontsize=8)
    ax2.plot(steps, [r["peak_memory_bytes"] / GIB for r in rows], marker="o", color="tab:red")
    # From 0 and without an offset: a peak that varies by bytes would otherwise get an axis of millionths of a GiB
    # whose offset label ("1e-6+1.58") sits on the title.
    ax2.set_ylim(bottom=0, top=1.1 * max(r["peak_memory_bytes"] for r in rows) / GIB)
    ax2.ticklabel_format(axis="y", style="plain", useOffset=False)
    ax2.set(xlabel="step", ylabel="peak memory (GiB)", title="peak memory per step")
    if metered:
        _bias_panel(axes[2], metered)
    return save_figure(fig, out)


def _bias_panel(ax: Any, rows: list[dict[str, Any]]) -> None:
    """The bias meter's numbers per metered step (`bias.py`): cosine (left axis), relative error (right)."""
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["bias_cosine"] for r in rows], marker="o", color="tab:green", label="cosine")
    ax.set_xlabel("step")
    ax.set_ylabel("cos(g_detach, g_exact)", color="tab:green")
    right = ax.twinx()
    right.plot(steps, [r["bias_rel_error"] for r in rows], marker="s", linestyle="--", color="tab:purple",
               label="relative error")
    right.set_ylabel("||g_detach - g_exact|| / ||g_exact||", color="tab:purple")
    ax.set_title("detach plan's gradient bias (meter)")
