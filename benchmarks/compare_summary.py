"""`python -m benchmarks compare`'s summary of finished runs: held-out reward per plan, weight divergence, bias meter.

`summarize` reads each run's summary.json, metrics.jsonl and checkpoint under OUT/<plan>-seed<k>/; `markdown` and
`plot` render its result as compare.md and compare.png.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from longstraw.train.config import TrainConfig

BASELINE = "standard"
CRITERION = 0.05  # the paper's acceptance threshold on |relative held-out reward difference|
# Fields compare sets per run (or manages itself); the rest must agree between invocations sharing OUT.
PER_RUN_FIELDS = ("plan", "seed", "run_dir", "resume", "overwrite", "force", "stop_after")
# Fields that change neither what is trained nor what is measured: free to differ between invocations.
FREE_FIELDS = ("device", "save_every", "tensorboard", "plot", "save_weights_only")
RUN_FILE = "compare-run.json"  # per run: wall time of the invocation that finished it


def comparable(cfg: TrainConfig) -> dict[str, Any]:
    """The config fields every run of one comparison shares."""
    return {k: v for k, v in cfg.to_flat().items() if k not in PER_RUN_FIELDS and k not in FREE_FIELDS}


def redo_hint(run_dir: Path) -> str:
    """How to get rid of a run that cannot be used."""
    return (f"delete {run_dir} to train that run again, choose another --out, or add --overwrite to rerun every "
            "run")


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

    run_dir_of = {(c.plan.plan.name, c.run.seed): Path(c.run.run_dir) for c in configs}
    runs = []
    for c in configs:
        rd = Path(c.run.run_dir)
        summary = read_json(rd / "summary.json", redo_hint(rd))
        rows = read_metrics(rd / "metrics.jsonl")
        if not rows:
            raise ValueError(f"{rd / 'metrics.jsonl'} holds no step: {redo_hint(rd)}")
        last = rows[-min(10, len(rows)):]
        timing = read_json(rd / RUN_FILE, "delete it (it only holds the run's wall time)") if (
            rd / RUN_FILE).is_file() else {}
        run = {"plan": c.plan.plan.name, "seed": c.run.seed, "run_dir": str(rd), "eval_before": summary["eval_before"],
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
        "config": comparable(first), "plans": plans, "seeds": seeds, "steps": first.optimizer.steps,
        "eval_prompts": first.run.eval_prompts, "baseline": BASELINE, "criterion": CRITERION,
        "held_out": held_out, "vs_standard": vs,
        "standard_spread": {"std": base["std"], "min": base["min"], "max": base["max"],
                            "range": base["max"] - base["min"],
                            "rel_std": base["std"] / abs(base["mean"]) if base["mean"] else None},
        "weight_divergence": weight_divergence(first.model.model, first.model.dtype, seeds, plans, run_dir_of),
        "runs": runs,
    }


def checks(result: dict[str, Any]) -> dict[str, Any]:
    """The paper's claim on a compare.json, per plan other than the baseline: `within_criterion`, its held-out reward
    within CRITERION (relative) of the baseline's, with `ok` None where that is not measurable (baseline mean 0)."""
    return {f"{plan}_within_criterion": {"ok": v["within_criterion"], "rel_diff": v["rel_diff"],
                                         "criterion": result["criterion"]}
            for plan, v in result["vs_standard"].items()}


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

    rows = {(c.plan.plan.name, c.run.seed): read_metrics(Path(c.run.run_dir) / "metrics.jsonl") for c in configs}
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
