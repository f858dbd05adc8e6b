"""`longstraw compare`: the same training run once per plan and seed, and what differs at the end.

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
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from longstraw.choices import PLANS
from longstraw.train.config import TrainConfig, load_toml, values_from_args
from longstraw.train.config import add_arguments as add_train_arguments

DEFAULT_PLANS = "standard,exact,detach"
BASELINE = "standard"
CRITERION = 0.05  # the paper's acceptance threshold on |relative held-out reward difference|
# Fields compare sets per run (or manages itself); the rest must agree between invocations sharing OUT.
PER_RUN_FIELDS = ("plan", "seed", "run_dir", "resume", "overwrite", "force", "stop_after")
# Fields that change neither what is trained nor what is measured: free to differ between invocations.
FREE_FIELDS = ("device", "save_every", "tensorboard", "plot", "save_weights_only")
# Fields a run's own checkpoint config may differ in from the comparison's run: where and how it was invoked.
RUN_INVOCATION_FIELDS = ("run_dir", "resume", "overwrite", "force", "stop_after")
CONFIG_FILE = "compare-config.json"
RUN_FILE = "compare-run.json"  # per run: wall time of the invocation that finished it
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
            configs.append(TrainConfig(**{
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
    if configs[0].eval_prompts < 1:
        raise ValueError("compare reads the held-out greedy reward of every run: eval_prompts must be >= 1")
    return seeds, configs


def _comparable(cfg: TrainConfig) -> dict[str, Any]:
    return {k: v for k, v in cfg.to_dict().items() if k not in PER_RUN_FIELDS and k not in FREE_FIELDS}


def read_json(path: Path, fix: str) -> Any:
    """A JSON file's value; ValueError naming the file and line when it is empty, cut short or not JSON."""
    raw = path.read_bytes()
    if not raw.strip():
        raise ValueError(f"{path} is empty: {fix}")
    try:
        return json.loads(raw)
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte 0x{raw[err.start]:02x}): {fix}") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno}; cut short or "
                         f"damaged?): {fix}") from None


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


def _redo(run_dir: Path) -> str:
    return (f"delete {run_dir} to train that run again, choose another --out, or add --overwrite to rerun every "
            "run")


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
                         f"{_redo(run_dir)}") from None
    if not (isinstance(data, dict) and isinstance(data.get("step"), int) and isinstance(data.get("config"), dict)):
        raise ValueError(f"checkpoint {path} lacks its step or config (not a LongStraw checkpoint?): "
                         f"{_redo(run_dir)}")
    return data["step"], data["config"]


def check_existing_run(cfg: TrainConfig) -> None:
    """Refuse a run already in `cfg.run_dir` that this comparison cannot reuse or resume as it is: trained with
    another config (the differences listed), past `cfg.steps`, or finished with files that do not read back."""
    run_dir = Path(cfg.run_dir)
    has_checkpoint = (run_dir / CHECKPOINT_FILE).is_file()
    summary_path = run_dir / "summary.json"
    if not has_checkpoint:
        if summary_path.is_file():
            raise ValueError(f"{run_dir} has summary.json but no {CHECKPOINT_FILE} (compare reads the final weights "
                             f"from it): {_redo(run_dir)}")
        return  # nothing saved: the run starts over
    step, saved = _checkpoint_step_and_config(run_dir)
    if step > cfg.steps:
        raise ValueError(f"{run_dir} was trained further than this comparison: its checkpoint is at step {step}, the "
                         f"comparison trains --steps {cfg.steps}; {_redo(run_dir)}")
    mine = cfg.to_dict()
    skip = RUN_INVOCATION_FIELDS + FREE_FIELDS
    differ = [f"{k}: {saved[k]!r} -> {v!r}" for k, v in mine.items() if k not in skip and k in saved and saved[k] != v]
    if differ:
        raise ValueError(f"{run_dir} holds a run of other settings than this comparison's {cfg.plan} seed {cfg.seed} "
                         f"({'; '.join(differ)}): {_redo(run_dir)}")
    if not summary_path.is_file():
        return  # unfinished: resumed from its checkpoint
    summary = read_json(summary_path, _redo(run_dir))
    finished = (isinstance(summary, dict) and isinstance(summary.get("eval_after"), (int, float))
                and isinstance(summary.get("eval_before"), (int, float)))
    if not finished:
        raise ValueError(f"{summary_path} lacks the held-out rewards (eval_before, eval_after): {_redo(run_dir)}")
    if summary.get("steps", step) != step or step != cfg.steps:
        raise ValueError(f"{summary_path} describes step {summary.get('steps')} but {CHECKPOINT_FILE} is at step "
                         f"{step} (the run changed after it finished): {_redo(run_dir)}")
    from longstraw.train.reporting import read_metrics

    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl: {_redo(run_dir)}")
    try:
        rows = read_metrics(metrics_path)
    except ValueError as err:
        raise ValueError(f"{err}: {_redo(run_dir)}") from None
    got = [r.get("step") for r in rows]
    if got != list(range(1, step + 1)) or not all(isinstance(r.get("reward_mean"), (int, float)) for r in rows):
        shown = "none" if not got else f"{got[0]}..{got[-1]} ({len(got)} rows)"
        raise ValueError(f"{metrics_path} holds step rows {shown}, not one row with reward_mean per step 1..{step}: "
                         f"{_redo(run_dir)}")


def run_all(configs: list[TrainConfig], overwrite: bool = False) -> None:
    """Train every run not finished yet (every run with `overwrite`), one line per run started / skipped /
    finished."""
    from longstraw.train import trainer

    for i, cfg in enumerate(configs, 1):
        run_dir = Path(cfg.run_dir)
        name = f"[{i}/{len(configs)}] {cfg.plan} seed {cfg.seed}"
        summary_path = run_dir / "summary.json"
        if summary_path.is_file() and not overwrite:  # checked by check_existing_run before anything ran
            after = read_json(summary_path, _redo(run_dir)).get("eval_after", float("nan"))
            print(f"compare: {name}: already finished ({summary_path} exists), not rerun; held-out greedy "
                  f"reward {after:.3f}", file=sys.stderr, flush=True)
            continue
        how = "resuming from its checkpoint" if cfg.resume else "started"
        print(f"compare: {name}: {how} ({run_dir})", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        summary = trainer.train(cfg)
        wall = time.perf_counter() - t0
        gc.collect()  # the finished run's model and optimizer, before the next run allocates its own
        (run_dir / RUN_FILE).write_text(json.dumps({"plan": cfg.plan, "seed": cfg.seed, "wall_s": wall,
                                                    "resumed": cfg.resume}) + "\n")
        print(f"compare: {name}: finished in {wall:.0f} s; held-out greedy reward "
              f"{summary.get('eval_before', float('nan')):.3f} -> {summary['eval_after']:.3f}",
              file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------- analysis


def _spread(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values), "per_seed": values}


def _relative(diff: float, base: float) -> float | None:
    """diff / |base|; None when the base is 0: no relative difference is measurable against it (0 vs 0 says
    nothing either: a model that never scores cannot show a plan training worse)."""
    if base != 0:
        return diff / abs(base)
    return None


def weight_divergence(model: str, dtype: str, seeds: list[int], plans: list[str],
                      run_dir_of: dict[tuple[str, int], Path]) -> dict[str, list[dict[str, float]]]:
    """Per plan other than the baseline and per seed: distances between the final weights of that plan's run
    and of the baseline's run of the same seed (trainable parameters, each once even if tied), in float64."""
    from longstraw.admission.loading import load_model
    from longstraw.train.checkpoints import load_checkpoint

    out: dict[str, list[dict[str, float]]] = {p: [] for p in plans if p != BASELINE}
    for seed in seeds:
        initial_model = load_model(model, dtype=dtype, device="cpu", seed=seed)  # presets: init depends on seed
        initial = {n: p.detach() for n, p in initial_model.named_parameters() if p.requires_grad}
        base = load_checkpoint(run_dir_of[BASELINE, seed])["model"]
        for plan in out:
            other = load_checkpoint(run_dir_of[plan, seed])["model"]
            dist = upd = norm = 0.0
            for name, w0 in initial.items():
                if name not in base or name not in other:
                    raise ValueError(f"parameter {name} is missing from a checkpoint of seed {seed}: the runs in "
                                     "this comparison were not trained from the same model")
                ws, wp = base[name].double(), other[name].double()
                dist += float((wp - ws).square().sum())
                upd += float((ws - w0.double()).square().sum())
                norm += float(ws.square().sum())
            dist, upd, norm = math.sqrt(dist), math.sqrt(upd), math.sqrt(norm)
            out[plan].append({
                "seed": seed, "distance": dist, "standard_update_norm": upd, "standard_weight_norm": norm,
                "rel_to_update": dist / upd if upd > 0 else float("nan"),
                "rel_to_weights": dist / norm if norm > 0 else float("nan"),
            })
            del other
        del base, initial, initial_model
    return out


def summarize(configs: list[TrainConfig], plans: list[str], seeds: list[int]) -> dict[str, Any]:
    """Everything compare.json holds (see the module docstring), from the finished runs' files."""
    from longstraw.train.reporting import read_metrics

    run_dir_of = {(c.plan, c.seed): Path(c.run_dir) for c in configs}
    runs = []
    for c in configs:
        rd = Path(c.run_dir)
        summary = read_json(rd / "summary.json", _redo(rd))
        rows = read_metrics(rd / "metrics.jsonl")
        if not rows:
            raise ValueError(f"{rd / 'metrics.jsonl'} holds no step: {_redo(rd)}")
        last = rows[-min(10, len(rows)):]
        timing = read_json(rd / RUN_FILE, "delete it (it only holds the run's wall time)") if (
            rd / RUN_FILE).is_file() else {}
        run = {"plan": c.plan, "seed": c.seed, "run_dir": str(rd), "eval_before": summary["eval_before"],
               "eval_after": summary["eval_after"], "sampled_reward_last": statistics.fmean(
                   r["reward_mean"] for r in last), "sampled_reward_last_steps": len(last),
               "wall_s": timing.get("wall_s")}
        metered = [r for r in rows if "bias_cosine" in r and math.isfinite(r["bias_cosine"])]
        if metered:
            run["bias_cosine_mean"] = statistics.fmean(r["bias_cosine"] for r in metered)
            run["bias_rel_error_mean"] = statistics.fmean(r["bias_rel_error"] for r in metered)
            run["bias_steps"] = len(metered)
        runs.append(run)
    by = {(r["plan"], r["seed"]): r for r in runs}
    held_out = {}
    for plan in plans:
        held_out[plan] = _spread([by[plan, s]["eval_after"] for s in seeds])
        held_out[plan]["before_mean"] = statistics.fmean(by[plan, s]["eval_before"] for s in seeds)
        held_out[plan]["sampled_reward_last_mean"] = statistics.fmean(by[plan, s]["sampled_reward_last"]
                                                                      for s in seeds)
    base = held_out[BASELINE]
    vs = {}
    for plan in plans:
        if plan == BASELINE:
            continue
        diff = held_out[plan]["mean"] - base["mean"]
        rel = _relative(diff, base["mean"])
        paired = [by[plan, s]["eval_after"] - by[BASELINE, s]["eval_after"] for s in seeds]
        vs[plan] = {
            "diff": diff, "rel_diff": rel,
            # None: not measurable (standard's mean is 0, so no relative difference exists).
            "within_criterion": None if rel is None else abs(rel) <= CRITERION,
            "diff_over_standard_std": diff / base["std"] if base["std"] > 0 else None,
            "paired_diff_per_seed": paired, "paired_diff_min": min(paired), "paired_diff_max": max(paired),
        }
    first = configs[0]
    return {
        "config": _comparable(first), "plans": plans, "seeds": seeds, "steps": first.steps,
        "eval_prompts": first.eval_prompts, "baseline": BASELINE, "criterion": CRITERION,
        "held_out": held_out, "vs_standard": vs,
        "standard_spread": {"std": base["std"], "min": base["min"], "max": base["max"],
                            "range": base["max"] - base["min"],
                            "rel_std": base["std"] / abs(base["mean"]) if base["mean"] else None},
        "weight_divergence": weight_divergence(first.model, first.dtype, seeds, plans, run_dir_of),
        "runs": runs,
    }


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(result: dict[str, Any]) -> str:
    n, steps, k = len(result["seeds"]), result["steps"], result["eval_prompts"]
    cfg = result["config"]
    lines = [
        f"# Plan comparison: {cfg['model']}, task {cfg['task']}, {steps} steps, {n} seed(s) "
        f"({', '.join(map(str, result['seeds']))})",
        "",
        f"Held-out greedy reward after training ({k} prompts never trained on), over seeds. Difference: plan mean "
        f"minus {BASELINE} mean; relative: divided by {BASELINE}'s mean; the paper's criterion: |relative| <= "
        f"{result['criterion']:.0%}. Paired: per seed (same data and initial weights), plan minus {BASELINE}.",
        "",
        "| plan | after: mean ± std | min – max | before: mean | diff vs standard | relative | within 5% "
        "| paired diff, min – max | sampled reward, last steps |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for plan in result["plans"]:
        h = result["held_out"][plan]
        v = result["vs_standard"].get(plan)
        if v is None:
            cmp = "(baseline) | | | "
        else:
            rel = "n/a" if v["rel_diff"] is None else f"{v['rel_diff']:+.1%}"
            within = {None: "not measurable", True: "yes", False: "no"}[v["within_criterion"]]
            cmp = (f"{v['diff']:+.3f} | {rel} | {within} | "
                   f"{v['paired_diff_min']:+.3f} – {v['paired_diff_max']:+.3f}")
        lines.append(f"| {plan} | {h['mean']:.3f} ± {h['std']:.3f} | {h['min']:.3f} – {h['max']:.3f} | "
                     f"{h['before_mean']:.3f} | {cmp} | {h['sampled_reward_last_mean']:.3f} |")
    s = result["standard_spread"]
    rel_std = "n/a" if s["rel_std"] is None else f"{s['rel_std']:.1%} of its mean"
    lines += [
        "",
        f"Seed spread of {BASELINE} itself (the noise a difference is read against): std {s['std']:.3f} "
        f"({rel_std}), range {s['min']:.3f} – {s['max']:.3f}. A difference smaller than this spread is not "
        "distinguishable from seed noise with this many seeds.",
        "",
        f"Weight divergence from {BASELINE} at the end (same seed): ||w_plan − w_standard|| / "
        "||w_standard − w_initial|| (relative to how far training moved the weights) and / ||w_standard||.",
        "",
        "| plan | seed | / update | / weights |",
        "|---|---|---|---|",
    ]
    for plan, rows in result["weight_divergence"].items():
        for r in rows:
            lines.append(f"| {plan} | {r['seed']} | {_num(r['rel_to_update'], '.3e')} | "
                         f"{_num(r['rel_to_weights'], '.3e')} |")
    metered = [r for r in result["runs"] if "bias_cosine_mean" in r]
    if metered:
        lines += ["", "Bias meter (detach runs, mean over the metered steps with a non-zero gradient): cosine and "
                  "relative error of the detach gradient against the exact one at the same weights.", "",
                  "| seed | metered steps | cosine | relative error |", "|---|---|---|---|"]
        for r in metered:
            lines.append(f"| {r['seed']} | {r['bias_steps']} | {r['bias_cosine_mean']:.4f} | "
                         f"{r['bias_rel_error_mean']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(configs: list[TrainConfig], result: dict[str, Any], out: Path) -> Path | None:
    """compare.png (see the module docstring); skipped with a note without matplotlib."""
    from longstraw.train.reporting import pyplot, read_metrics, save_figure

    plt = pyplot("compare.png")
    if plt is None:
        return None

    rows = {(c.plan, c.seed): read_metrics(Path(c.run_dir) / "metrics.jsonl") for c in configs}
    plans, seeds = result["plans"], result["seeds"]
    metered = any("bias_cosine_mean" in r for r in result["runs"])
    fig, axes = plt.subplots(1, 3 if metered else 2, figsize=(16 if metered else 11, 4))
    colors = {p: f"C{i}" for i, p in enumerate(plans)}
    for plan in plans:
        per_seed = [[r["reward_mean"] for r in rows[plan, s]] for s in seeds]
        steps = [r["step"] for r in rows[plan, seeds[0]]]
        by_step = list(zip(*per_seed))
        axes[0].plot(steps, [statistics.fmean(v) for v in by_step], color=colors[plan], label=plan)
        axes[0].fill_between(steps, [min(v) for v in by_step], [max(v) for v in by_step], color=colors[plan],
                             alpha=0.2)
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("reward")
    axes[0].set_title(f"sampled reward (mean over {len(seeds)} seeds, min–max band)")
    axes[0].legend()
    steps_total = result["steps"]
    offset = 0.015 * steps_total  # side by side, so the bars do not hide each other
    for i, plan in enumerate(plans):
        x = [0 + (i - (len(plans) - 1) / 2) * offset, steps_total + (i - (len(plans) - 1) / 2) * offset]
        before = [by["eval_before"] for by in result["runs"] if by["plan"] == plan]
        after = [by["eval_after"] for by in result["runs"] if by["plan"] == plan]
        means = [statistics.fmean(before), statistics.fmean(after)]
        low = [means[0] - min(before), means[1] - min(after)]
        high = [max(before) - means[0], max(after) - means[1]]
        axes[1].errorbar(x, means, yerr=[low, high], marker="o", capsize=4, color=colors[plan], label=plan)
    axes[1].set_xticks([0, steps_total])
    axes[1].set_xticklabels(["before", f"after {steps_total} steps"])
    axes[1].set_ylabel("reward")
    axes[1].set_title(f"held-out greedy reward ({result['eval_prompts']} prompts; mean, min–max over seeds)")
    axes[1].legend()
    if metered:
        for s in seeds:
            points = [r for r in rows["detach", s] if "bias_cosine" in r]
            axes[2].plot([r["step"] for r in points], [r["bias_cosine"] for r in points], marker="o",
                         label=f"seed {s}")
        axes[2].set_xlabel("step")
        axes[2].set_ylabel("cos(g_detach, g_exact)")
        axes[2].set_title("bias meter: detach vs exact gradient")
        axes[2].legend()
    return save_figure(fig, out / "compare.png")


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
    check_same_experiment(out, _comparable(configs[0]))
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
    record_experiment(out, _comparable(configs[0]))
    run_all(configs, overwrite)
    result = summarize(configs, plans, seeds)
    _write_atomically(out / "compare.json", json.dumps(result, indent=2) + "\n")
    _write_atomically(out / "compare.md", markdown(result))
    written = ["compare.json", "compare.md"]
    if values.get("plot", True) and plot(configs, result, out):  # --no-plot: no compare.png either
        written.append("compare.png")
    print(markdown(result))
    print(f"compare: outputs in {out}: {', '.join(written)}", file=sys.stderr)
    return result


def run_from_args(args: argparse.Namespace) -> int:
    """`longstraw compare ...`: check the flags, then `compare`; an expected error is one line and status 1."""
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
        print(f"longstraw compare: stopped by {signal.Signals(signum).name}; run the same command again to "
              "continue (finished runs are kept, the interrupted one resumes)", file=sys.stderr)
        return 128 + int(signum)
    except (ValueError, FileNotFoundError, FloatingPointError) as err:
        if args.debug:
            raise
        print(f"longstraw compare: error: {err}", file=sys.stderr)
        return 1
    return 0

