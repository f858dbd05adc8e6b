"""`python -m benchmarks compare`: the same training run once per plan and seed, and what differs at the end.

The source paper's own check of its detached plan: train it and the standard plan on a small model and accept a
held-out reward difference under 5%. For every (seed, plan) this runs the unmodified trainer (`trainer.train`)
with `plan` and `seed` replaced, in OUT/<plan>-seed<k>/; the config, the data (a pure function of the seed and
step) and the initial weights are the same for every plan of a seed. Then it writes, into OUT:

- compare.json / compare.md: final held-out greedy reward per plan over seeds (mean, std, min, max), its
  difference from `standard` (absolute, relative, and per seed: same seed = same data and initial weights), whether
  |relative difference| <= 5%, and `standard`'s own seed spread, the noise floor the difference is read against;
  the weight divergence from `standard` at the end, per seed, read from the runs' checkpoints:
  ||w_plan - w_standard|| / ||w_standard - w_initial|| (relative to how far training moved the weights) and
  ||w_plan - w_standard|| / ||w_standard||; and the bias meter's mean numbers for detach runs that have them;
- compare.png: sampled reward per step (mean over seeds, min-max band) and held-out greedy reward before and
  after training (mean, min-max bars: the trainer evaluates only then), per plan; the bias meter's cosine when
  detach runs were metered (`--bias-every`, applied to the detach runs only).

Resumable: a run whose summary.json exists is not rerun (a line says so); one that stopped with a checkpoint is
resumed (`--resume`), one that stopped before its first checkpoint is started over. OUT/compare-config.json holds
the compared config; a rerun with other settings is refused (they would mix two experiments), except for the
plans and seeds, which may grow but not shrink (compare.json would lose runs it summarised). The record binds once
some run has a checkpoint: a first invocation that failed before any run saved one leaves nothing to refuse.
Every run found in OUT is checked against the run this comparison would train before anything is written or
trained: its checkpoint's config (what differs is listed), its step (a run trained further than --steps is
refused), and that summary.json and metrics.jsonl read back whole. `--overwrite` (command line only: a TOML file
cannot ask for it) reruns everything.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.compare_summary import (
    BASELINE,
    FREE_FIELDS,
    RUN_FILE,
    checks,
    comparable,
    markdown,
    plot,
    read_json,
    redo_hint,
    summarize,
)
from benchmarks.registry import Benchmark
from longstraw.choices import PLANS
from longstraw.train.config import TrainConfig, load_toml, values_from_args
from longstraw.train.config import add_arguments as add_train_arguments

DEFAULT_PLANS = "standard,exact,detach"
# Fields a run's own checkpoint config may differ in from the comparison's run: where and how it was invoked.
RUN_INVOCATION_FIELDS = ("run_dir", "resume", "overwrite", "force", "stop_after")
CONFIG_FILE = "compare-config.json"
CHECKPOINT_FILE = "checkpoint.pt"  # checkpoints.FILENAME, named here so the command's checks import no torch
# Each seed trains one run per plan; beyond this a typo (an extra digit) would start days of runs.
MAX_SEEDS = 100


# Train flags that compare sets itself: refused with the reason when given, hidden from --help.
REFUSED_FLAGS = {"plan": "compare runs every plan of --plans", "run_dir": "the runs go under --out",
                 "resume": "compare resumes unfinished runs itself",
                 "stop_after": "every run of a comparison runs to --steps",
                 "force": "a comparison's runs must share one config"}
# TOML keys a train config file normally sets and compare replaces for every run: accepted with a note, so a
# train TOML (examples/demo.toml) serves both commands. The other refused flags are refused as TOML keys too.
REPLACED_KEYS = ("plan", "run_dir")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser)
    for action in parser._actions:  # argparse has no public way to hide an added option
        if action.dest in REFUSED_FLAGS:
            action.help = argparse.SUPPRESS
    parser.add_argument("--plans", default=DEFAULT_PLANS,
                        help=f"comma-separated plans to compare, of {', '.join(PLANS)}; {BASELINE} included "
                             f"(default: {DEFAULT_PLANS})")
    parser.add_argument("--seeds", type=seed_count, default=3,
                        help=f"seeds per plan, 1 to {MAX_SEEDS}: seed, seed+1, ... (the config's seed first; "
                             "default: 3)")
    parser.add_argument("--out", default=None,
                        help="parent directory of the runs and of compare.{md,json,png} (default: "
                             "runs/compare-<config file name>)")
    parser.add_argument("--debug", action="store_true", help="on an expected error also print the traceback")


def seed_count(text: str) -> int:
    """--seeds: a whole number (its range is checked by `plan_runs`, for callers from Python too)."""
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a number of seeds (runs of seed, seed+1, ..., seed+N-1), e.g. --seeds 3; got {text!r}: a "
            "range is not accepted, set the first seed with --seed") from None


def parse_plans(text: str) -> list[str]:
    plans = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in plans if p not in PLANS]
    if unknown:
        raise ValueError(f"--plans: unknown plan(s) {', '.join(unknown)}; choose from {', '.join(PLANS)}")
    if len(set(plans)) != len(plans):
        raise ValueError(f"--plans: {text!r} names a plan twice")
    if BASELINE not in plans:
        raise ValueError(f"--plans: every plan is measured against {BASELINE}; include it (e.g. --plans "
                         f"{BASELINE},{','.join(plans) or 'detach'})")
    if len(plans) < 2:
        raise ValueError(f"--plans: give {BASELINE} and at least one plan to compare with it")
    return plans


def run_configs(values: dict[str, Any], plans: list[str], seeds: list[int], out: Path,
                overwrite: bool) -> list[TrainConfig]:
    """One TrainConfig per (seed, plan), seed-major (all plans of the first seed finish first); all validated
    before any run starts. The bias meter applies to detach runs only (other plans have no bias to measure)."""
    configs = []
    for seed in seeds:
        for plan in plans:
            run_dir = out / f"{plan}-seed{seed}"
            has_checkpoint = (run_dir / "checkpoint.pt").is_file()
            configs.append(TrainConfig.from_flat({
                **values, "plan": plan, "seed": seed, "run_dir": str(run_dir),
                "bias_every": values.get("bias_every", 0) if plan == "detach" else 0,
                "resume": has_checkpoint and not overwrite,
                # A run that stopped before its first checkpoint has nothing to resume: it starts over.
                "overwrite": overwrite or not has_checkpoint, "force": False, "stop_after": 0,
            }))
    return configs


def plan_runs(values: dict[str, Any], plans: list[str], n_seeds: int, out: Path,
              overwrite: bool) -> tuple[list[int], list[TrainConfig]]:
    """The seeds and every run's config, checked (ValueError) before anything is written."""
    if n_seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {n_seeds}")
    if n_seeds > MAX_SEEDS:
        raise ValueError(f"--seeds must be <= {MAX_SEEDS}, got {n_seeds}: each seed trains one run per plan; split a "
                         "larger study into comparisons with other --seed and --out")
    seed0 = int(values.get("seed", 0))
    if seed0 + n_seeds > 2**63:
        raise ValueError(f"--seeds {n_seeds} from seed {seed0} passes the largest seed (2**63 - 1): lower --seed")
    seeds = [seed0 + k for k in range(n_seeds)]
    configs = run_configs(values, plans, seeds, out, overwrite)
    if configs[0].run.eval_prompts < 1:
        raise ValueError("compare reads the held-out greedy reward of every run: eval_prompts must be >= 1")
    return seeds, configs


def _write_atomically(path: Path, text: str) -> None:
    """Write through a temporary file and a rename, so an interrupted write never leaves a truncated file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _runs_with_progress(out: Path) -> list[Path]:
    """Run directories under `out` holding a checkpoint or a summary: work that a change of settings would mix."""
    if not out.is_dir():
        return []
    return sorted(d for d in out.iterdir()
                  if d.is_dir() and ((d / CHECKPOINT_FILE).is_file() or (d / "summary.json").is_file()))


def check_same_experiment(out: Path, mine: dict[str, Any]) -> None:
    """Refuse to mix two experiments in one OUT: the compared settings must equal the recorded ones, once a run
    has saved something under them (until then the record is of an attempt that trained nothing: replaced)."""
    path = out / CONFIG_FILE
    if not path.is_file():
        return
    saved = read_json(path, f"delete it (every run in {out} is still checked against this comparison)")
    if not isinstance(saved, dict):
        raise ValueError(f"{path} is not a JSON object: delete it (every run in {out} is still checked against this "
                         "comparison)")
    differ = [f"{k}: {saved[k]!r} -> {mine[k]!r}" for k in mine if k in saved and saved[k] != mine[k]]
    if not differ:
        return
    progressed = _runs_with_progress(out)
    if not progressed:
        print(f"compare: {path} records other settings ({'; '.join(differ)}), but no run has saved a step under "
              "them: replaced", file=sys.stderr)
        return
    raise ValueError(f"{out} holds a comparison of other settings ({'; '.join(differ)}): choose another --out, or "
                     "add --overwrite to rerun every run with the new ones")


def record_experiment(out: Path, mine: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    _write_atomically(out / CONFIG_FILE, json.dumps(mine, indent=2) + "\n")


def check_out_dir(out: Path) -> None:
    """--out must be a directory, or creatable as one (checked without creating it)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a directory: choose another --out")
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"--out {out}: {parent} is a file, so the directory cannot be created: choose another --out")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out}: {parent} is not writable: choose another --out")


def check_summary_kept(out: Path, plans: list[str], seeds: list[int]) -> None:
    """Refuse an invocation whose compare.json would lose plans or seeds the existing one summarises."""
    path = out / "compare.json"
    if not path.is_file():
        return
    fix = "delete it to summarise only this invocation's runs"
    old = read_json(path, fix)
    if not (isinstance(old, dict) and isinstance(old.get("plans"), list) and isinstance(old.get("seeds"), list)):
        raise ValueError(f"{path} lacks its plans and seeds (not written by compare?): {fix}")
    lost_plans = [p for p in old["plans"] if p not in plans]
    lost_seeds = [s for s in old["seeds"] if s not in seeds]
    if not lost_plans and not lost_seeds:
        return
    lost = ([f"plan(s) {', '.join(lost_plans)}"] if lost_plans else []) + (
        [f"seed(s) {', '.join(map(str, lost_seeds))}"] if lost_seeds else [])
    all_plans = plans + [p for p in old["plans"] if p not in plans]
    n_seeds = max([*seeds, *(s for s in old["seeds"] if isinstance(s, int))]) - seeds[0] + 1
    raise ValueError(f"{path} summarises {' and '.join(lost)} that this invocation leaves out, and rewriting it would "
                     f"drop them: pass --plans {','.join(all_plans)} --seeds {n_seeds} (finished runs are reused), "
                     "or choose another --out")


def _checkpoint_step_and_config(run_dir: Path) -> tuple[int, dict[str, Any]]:
    """A checkpoint's step and config, read without its tensors' bytes (memory-mapped, not checksummed: the weight
    divergence later loads the whole checkpoint and verifies it)."""
    import torch

    path = run_dir / CHECKPOINT_FILE
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # torch raises several types for truncated/corrupt files
        first = str(err).splitlines()[0] if str(err) else ""
        raise ValueError(f"checkpoint {path} cannot be read ({type(err).__name__}: {first}): "
                         f"{redo_hint(run_dir)}") from None
    if not (isinstance(data, dict) and isinstance(data.get("step"), int) and isinstance(data.get("config"), dict)):
        raise ValueError(f"checkpoint {path} lacks its step or config (not a LongStraw checkpoint?): "
                         f"{redo_hint(run_dir)}")
    return data["step"], data["config"]


def check_existing_run(cfg: TrainConfig) -> None:
    """Refuse a run already in its run_dir that this comparison cannot reuse or resume as it is: trained with
    another config (the differences listed), past its steps, or finished with files that do not read back."""
    run_dir = Path(cfg.run.run_dir)
    has_checkpoint = (run_dir / CHECKPOINT_FILE).is_file()
    summary_path = run_dir / "summary.json"
    if not has_checkpoint:
        if summary_path.is_file():
            raise ValueError(f"{run_dir} has summary.json but no {CHECKPOINT_FILE} (compare reads the final weights "
                             f"from it): {redo_hint(run_dir)}")
        return  # nothing saved: the run starts over
    step, saved = _checkpoint_step_and_config(run_dir)
    if step > cfg.optimizer.steps:
        raise ValueError(f"{run_dir} was trained further than this comparison: its checkpoint is at step {step}, the "
                         f"comparison trains --steps {cfg.optimizer.steps}; {redo_hint(run_dir)}")
    mine = cfg.to_flat()
    skip = RUN_INVOCATION_FIELDS + FREE_FIELDS
    differ = [f"{k}: {saved[k]!r} -> {v!r}" for k, v in mine.items() if k not in skip and k in saved and saved[k] != v]
    if differ:
        raise ValueError(f"{run_dir} holds a run of other settings than this comparison's {cfg.plan.plan} seed "
                         f"{cfg.run.seed} ({'; '.join(differ)}): {redo_hint(run_dir)}")
    if not summary_path.is_file():
        return  # unfinished: resumed from its checkpoint
    summary = read_json(summary_path, redo_hint(run_dir))
    finished = (isinstance(summary, dict) and isinstance(summary.get("eval_after"), (int, float))
                and isinstance(summary.get("eval_before"), (int, float)))
    if not finished:
        raise ValueError(f"{summary_path} lacks the held-out rewards (eval_before, eval_after): {redo_hint(run_dir)}")
    if summary.get("steps", step) != step or step != cfg.optimizer.steps:
        raise ValueError(f"{summary_path} describes step {summary.get('steps')} but {CHECKPOINT_FILE} is at step "
                         f"{step} (the run changed after it finished): {redo_hint(run_dir)}")
    from longstraw.train.reporting import read_metrics

    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl: {redo_hint(run_dir)}")
    try:
        rows = read_metrics(metrics_path)
    except ValueError as err:
        raise ValueError(f"{err}: {redo_hint(run_dir)}") from None
    got = [r.get("step") for r in rows]
    if got != list(range(1, step + 1)) or not all(isinstance(r.get("reward_mean"), (int, float)) for r in rows):
        shown = "none" if not got else f"{got[0]}..{got[-1]} ({len(got)} rows)"
        raise ValueError(f"{metrics_path} holds step rows {shown}, not one row with reward_mean per step 1..{step}: "
                         f"{redo_hint(run_dir)}")


def run_all(configs: list[TrainConfig], overwrite: bool = False) -> None:
    """Train every run not finished yet (every run with `overwrite`), one line per run started / skipped /
    finished."""
    from longstraw.train import trainer

    for i, cfg in enumerate(configs, 1):
        run_dir = Path(cfg.run.run_dir)
        name = f"[{i}/{len(configs)}] {cfg.plan.plan} seed {cfg.run.seed}"
        summary_path = run_dir / "summary.json"
        if summary_path.is_file() and not overwrite:  # checked by check_existing_run before anything ran
            after = read_json(summary_path, redo_hint(run_dir)).get("eval_after", float("nan"))
            print(f"compare: {name}: already finished ({summary_path} exists), not rerun; held-out greedy "
                  f"reward {after:.3f}", flush=True)
            continue
        how = "resuming from its checkpoint" if cfg.run.resume else "started"
        print(f"compare: {name}: {how} ({run_dir})", flush=True)
        t0 = time.perf_counter()
        summary = trainer.train(cfg)
        wall = time.perf_counter() - t0
        gc.collect()  # the finished run's model and optimizer, before the next run allocates its own
        (run_dir / RUN_FILE).write_text(json.dumps({"plan": cfg.plan.plan.name, "seed": cfg.run.seed, "wall_s": wall,
                                                    "resumed": cfg.run.resume}) + "\n")
        print(f"compare: {name}: finished in {wall:.0f} s; held-out greedy reward "
              f"{summary.get('eval_before', float('nan')):.3f} -> {summary['eval_after']:.3f}",
              flush=True)


# ---------------------------------------------------------------------------------------------------- command


def check_options(values: dict[str, Any], plans: list[str], n_seeds: int, out: Path,
                  overwrite: bool) -> tuple[list[int], list[TrainConfig]]:
    """The options, checked without loading a model and before anything is written: every run's config, --out, the
    data file (its rows, reward function and held-out split), the model's name and the positions its config declares.
    ValueError with what to change."""
    from longstraw.train.data import check_data, check_model

    seeds, configs = plan_runs(values, plans, n_seeds, out, overwrite)
    check_out_dir(out)
    check_data(configs[0])
    check_model(configs[0])
    return seeds, configs


def check_out_state(plans: list[str], seeds: list[int], configs: list[TrainConfig], out: Path,
                    overwrite: bool) -> None:
    """What OUT already holds, checked before anything is written: the recorded experiment, that compare.json keeps
    its plans and seeds, and every run already there (`check_existing_run`). Nothing to check with overwrite."""
    if overwrite:
        return
    check_same_experiment(out, comparable(configs[0]))
    check_summary_kept(out, plans, seeds)
    for cfg in configs:
        check_existing_run(cfg)


def compare(values: dict[str, Any], plans: list[str], n_seeds: int, out: Path, overwrite: bool = False,
            ) -> dict[str, Any]:
    """Run (or reuse) every (seed, plan) run and write compare.{json,md,png} into `out`; returns the result."""
    seeds, configs = check_options(values, plans, n_seeds, out, overwrite)
    return run_checked(values, plans, seeds, configs, out, overwrite)


def run_checked(values: dict[str, Any], plans: list[str], seeds: list[int], configs: list[TrainConfig], out: Path,
                overwrite: bool) -> dict[str, Any]:
    """`compare` once its options are checked: lock OUT (one comparison writes it at a time), then `_run_locked`."""
    from longstraw.train.rundir import RunLock  # here: this module is imported for --help, which loads no torch

    out.mkdir(parents=True, exist_ok=True)
    lock = RunLock.acquire(out, what="--out", option="--out")
    try:
        return _run_locked(values, plans, seeds, configs, out, overwrite)
    finally:
        lock.release()


def _run_locked(values: dict[str, Any], plans: list[str], seeds: list[int], configs: list[TrainConfig], out: Path,
                overwrite: bool) -> dict[str, Any]:
    """Check OUT, record the experiment, train what is missing, write the outputs."""
    check_out_state(plans, seeds, configs, out, overwrite)
    record_experiment(out, comparable(configs[0]))
    run_all(configs, overwrite)
    result = summarize(configs, plans, seeds)
    _write_atomically(out / "compare.json", json.dumps(result, indent=2) + "\n")
    _write_atomically(out / "compare.md", markdown(result))
    written = ["compare.json", "compare.md"]
    if values.get("plot", True) and plot(configs, result, out):  # --no-plot: no compare.png either
        written.append("compare.png")
    print(markdown(result))
    print(f"compare: outputs in {out}: {', '.join(written)}")
    return result


def run_from_args(args: argparse.Namespace) -> int:
    """`python -m benchmarks compare ...`: check the flags, then `compare`; an expected error is one line and
    status 1."""
    import signal

    for name, why in REFUSED_FLAGS.items():
        if getattr(args, name, None) is not None:
            args.fail(f"--{name.replace('_', '-')} does not apply to compare: {why}")
    try:
        file_keys = load_toml(args.config) if args.config else {}
        refused = [k for k in file_keys if k in REFUSED_FLAGS and k not in REPLACED_KEYS]
        if refused:
            reasons = "; ".join(f"{k}: {REFUSED_FLAGS[k]}" for k in refused)
            raise ValueError(f"{args.config}: compare does not use {', '.join(refused)} ({reasons}): remove them from "
                             "the file")
        values = values_from_args(args)
        replaced = [k for k in REPLACED_KEYS if k in file_keys]
        for key in replaced:
            del values[key]
        plans = parse_plans(args.plans)
        if args.out is not None:
            out = Path(args.out)
        else:
            out = Path("runs") / f"compare-{Path(args.config).stem if args.config else 'flags'}"
        overwrite = bool(values.get("overwrite", False))
        seeds, configs = check_options(values, plans, args.seeds, out, overwrite)  # a usage error
    except (ValueError, FileNotFoundError) as err:
        args.fail(str(err))
    if replaced:
        print(f"compare: {args.config}'s {' and '.join(replaced)} not used: the runs go under {out}, one per plan of "
              "--plans", file=sys.stderr)
    try:
        run_checked(values, plans, seeds, configs, out, overwrite)
    except KeyboardInterrupt as err:
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"python -m benchmarks compare: stopped by {signal.Signals(signum).name}; run the same command again to "
              "continue (finished runs are kept, the interrupted one resumes)", file=sys.stderr)
        return 128 + int(signum)
    except (ValueError, FileNotFoundError, FloatingPointError) as err:
        if args.debug:
            raise
        print(f"python -m benchmarks compare: error: {err}", file=sys.stderr)
        return 1
    return 0



BENCHMARKS = (
    Benchmark(
        name="compare", help="the same training run per plan and seed: held-out reward, weight divergence, plot",
        description="Train one config once per plan (--plans) and seed (--seeds), each run in OUT/<plan>-seed<k>/; "
                    "write OUT/compare.{md,json,png}: held-out reward per plan (mean, std, min-max over seeds), "
                    "the difference from standard and the paper's 5% criterion, weight divergence from "
                    "standard. Finished runs are not rerun. Options from an optional TOML file, overridden by flags.",
        add_arguments=add_arguments, run=run_from_args, table=markdown, checks=checks,
    ),
)
