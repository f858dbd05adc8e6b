"""`python -m benchmarks memory`: Bench B1 (docs/design.md §5), peak memory and step time of every plan across group
sizes.

Each (plan, G, checkpoint) configuration runs in a fresh `benchmarks.worker` subprocess so its peak is its own (a
process's high-water mark never comes down on its own). A failed worker (OOM-killed, error, timeout) is
recorded with its stderr tail and the bench moves on. The result file holds the config, the machine, every
result and the ratios; the table and ratios are also printed. Plans are compared as ratios from one run
(docs/design.md §5).

Workers run with glibc's mmap threshold fixed, so peaks repeat within 1 MiB (why: `benchmarks/common.py`).

`--checkpoint none layers` measures every plan with and without per-layer activation checkpointing side by
side (one table column per plan and checkpoint; `<plan>+ckpt` is checkpointed). On CPU each measured peak is
printed beside the planner's forecast of it (`planner vs measured`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, NoReturn

from benchmarks.common import (
    B1,
    B1_ARCHS,
    MIB,
    PEAK_RESOLUTION,
    MemoryBenchConfig,
    arch_preset,
    busy,
    check_device,
    check_model,
    check_out,
    default_out,
    non_negative_int,
    peak_text,
    positive_float,
    predictor,
    run_batch,
    smoke_summary,
    write_json,
    write_results,
)
from benchmarks.common import run_one as run_one  # where the tests and older callers import it from
from benchmarks.flops import group_floor, preset_costs
from benchmarks.machine import machine_info
from benchmarks.registry import Benchmark
from longstraw.choices import CHECKPOINT_CHOICES, DTYPES, PLANS, PRESET_NAMES
from longstraw.planner import positive_int

# --demo: B1 at two group sizes, so its G=8 ratios are B1's: about 100 s on 2 idle CPU cores, about 3 min
# when other processes hold a core. P=2048, R=128 took 61 s but changes the ratios (10x, not 16x).
DEMO = replace(B1, groups=(2, 8))
# --smoke: the tiny preset; seconds, most of it process start-up. Used by the test.
SMOKE = replace(B1, model="tiny-llama", prompt_tokens=64, response_tokens=8, groups=(2, 4), chunk_size=32,
                isolate=False, smoke=True)


# ---------------------------------------------------------------- running


def column_label(plan: str, checkpoint: str = "none") -> str:
    """A table column / plot line: the plan, `<plan>+ckpt` with per-layer activation checkpointing."""
    return plan if checkpoint == "none" else f"{plan}+ckpt"


def _checkpoint_of(entry: dict[str, Any]) -> str:
    return str(entry.get("checkpoint", "none"))  # result files from before the checkpoint dimension: none


def _progress_line(index: int, total: int, entry: dict[str, Any]) -> str:
    label = column_label(str(entry["plan"]), _checkpoint_of(entry))
    head = f"[{index}/{total}] G={entry['group_size']:<3} {label:<17}"
    if entry["status"] == "ok":
        notes = "" if entry.get("hwm_reset", True) else "  (HWM not reset: peak may be overstated)"
        if busy(entry):
            notes += f"  (host busy: CPU pressure {entry['cpu_pressure']:.0%}, time inflated)"
        return (f"{head} peak {peak_text(float(entry['peak_bytes']))} MiB  step {entry['time_s']:8.2f} s  "
                f"(process {entry['process_s']:.1f} s){notes}")
    return f"{head} FAILED: {entry['error']}"


def _document(config: MemoryBenchConfig, machine: dict[str, Any], results: list[dict[str, Any]],
              started: str) -> dict[str, Any]:
    return {
        "bench": "memory",
        "started": started,
        "config": asdict(config),
        "machine": machine,
        "results": results,
        "ratios": {**compute_ratios(results), **flop_floors(config, results)},
    }


def flop_floors(config: MemoryBenchConfig, results: list[dict[str, Any]]) -> dict[str, Any]:
    """At the reference G, per replay plan: standard's FLOP count over the plan's (`benchmarks/flops.py`), and the
    share of it the measured wall and CPU time ratios reach (None where a run is missing or the model has no count)."""
    g_ref = reference_group_size(sorted({int(r["group_size"]) for r in results}))
    c = preset_costs(config.model)
    prompt, response = config.prompt_tokens, config.turns * (config.response_tokens + config.observation_tokens)
    out: dict[str, Any] = {"flop_floor": {}, "share_of_flop_floor": {}, "cpu_share_of_flop_floor": {}}
    for plan in ("detach", "exact"):
        floor = None if g_ref is None else group_floor(c, plan, prompt, response, g_ref,
                                                       config.turns * config.response_tokens)
        out["flop_floor"][plan] = floor
        for name, key in (("share_of_flop_floor", "time_s"), ("cpu_share_of_flop_floor", "cpu_time_s")):
            ratio = None if g_ref is None else _ratio(results, key, "standard", plan, g_ref)
            out[name][plan] = None if ratio is None or floor is None else ratio / floor
    return out


def run_memory_bench(config: MemoryBenchConfig, out: str) -> dict[str, Any]:
    """Run every (G, plan, checkpoint) configuration, print progress/table/ratios and, on CPU, the planner's
    prediction beside each measured peak; write the result JSON to `out`."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    started = time.strftime("%Y-%m-%dT%H:%M:%S")
    machine = machine_info(config.device)
    grid = [(g, plan, ckpt) for g in config.groups for plan in config.plans for ckpt in config.checkpoints]
    print(f"bench memory: {describe(config)}; {len(grid)} configurations, one process each", file=sys.stderr)
    predict = _planner(config)
    results: list[dict[str, Any]] = []
    partial = out + ".tmp"
    batches = [[job] for job in grid] if config.isolate else [grid]
    for batch in batches:
        for entry in run_batch([(config, plan, g, ckpt) for g, plan, ckpt in batch], isolate=config.isolate):
            add_prediction(entry, config, predict)
            results.append(entry)
            print(_progress_line(len(results), len(grid), entry), file=sys.stderr, flush=True)
        # A partial file after each configuration: a long run that is interrupted keeps what it measured.
        write_json(partial, _document(config, machine, results, started))
    document = _document(config, machine, results, started)
    document["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    written = write_results(out, document, "bench memory")
    if written is not None and os.path.exists(partial):
        os.remove(partial)
    print(describe(config))
    if config.smoke:
        print(smoke_summary(results, "bench memory"))
    else:
        print(format_table(results, config.groups, config.plans, config.checkpoints))
        predictions = format_predictions(results)
        if predictions:
            print(predictions)
        print(format_ratios(document["ratios"]))
    contended = [f"G={r['group_size']} {column_label(str(r['plan']), _checkpoint_of(r))}" for r in results if busy(r)]
    if contended and not config.smoke:
        print(f"warning: other processes competed for the CPU during {len(contended)} of {len(results)} steps "
              f"({', '.join(contended)}): their times, and the time ratios, are inflated; peaks are not affected")
    from benchmarks.plots import plot_memory

    # One line per table column: checkpointed runs are their own series, not mixed into their plan's.
    plotted = {**document, "results": [{**r, "plan": column_label(str(r["plan"]), _checkpoint_of(r))}
                                       for r in results]}
    if written is None:
        return document
    png = plot_memory(plotted, os.path.splitext(written)[0] + ".png")
    print(f"results: {written}" + (f", plot: {png}" if png else ""))
    return document


def describe(config: MemoryBenchConfig) -> str:
    return (f"{config.model} {config.dtype} on {config.device}, "
            f"P={config.prompt_tokens} R={config.response_tokens}"
            + (f" x {config.turns} turns + {config.observation_tokens} observation tokens each (masked)"
               if config.observation_tokens else "")
            + f", G in {list(config.groups)}, "
            f"chunk {config.chunk_size}, micro-batch {config.micro_batch}, "
            f"checkpoint {' + '.join(config.checkpoints)}"
            + (", prompt state offloaded" if config.offload_state else "")
            + (f", max positions {config.max_positions}" if config.max_positions else "")
            + (f", time: the fastest of {config.warm_steps} warm steps" if config.warm_steps else ""))


# ---------------------------------------------------------------- planner prediction


def _planner(config: MemoryBenchConfig):
    """The planner's CPU step-bytes forecast (`bench.common.predictor`), or None: off CPU (a CUDA peak is
    another quantity) or for a model the planner cannot read (then silently: the bench runs without it)."""
    if config.device != "cpu":
        return None
    return predictor(config.model, config.dtype, quiet=True)


def add_prediction(entry: dict[str, Any], config: MemoryBenchConfig, predict) -> None:
    """Add `predicted_step_bytes` and `prediction_error` (predicted / measured - 1; None when the measured peak
    is not positive) to an ok entry. Nothing when there is no predictor or the planner rejects the input."""
    if predict is None or entry.get("status") != "ok":
        return
    try:
        g = int(entry["group_size"])
        response_tokens = config.turns * (config.response_tokens + config.observation_tokens)
        predicted = int(predict(config.prompt_tokens, response_tokens, g, str(entry["plan"]),
                                config.chunk_size, config.micro_batch,
                                checkpoint_layers=_checkpoint_of(entry) == "layers",
                                offload_state=config.offload_state))
    except Exception:  # a forecast is a side note: it must not cost a measurement
        return
    measured = float(entry["peak_bytes"])
    entry["predicted_step_bytes"] = predicted
    entry["prediction_error"] = predicted / measured - 1 if measured >= PEAK_RESOLUTION else None


def format_predictions(results: list[dict[str, Any]]) -> str:
    """`planner vs measured`: one line per ok entry with a prediction; "" when there is none."""
    rows = [r for r in results if r.get("status") == "ok" and r.get("predicted_step_bytes") is not None]
    if not rows:
        return ""
    lines = ["planner vs measured (step peak above the loaded model):",
             f"  {'G':>4}  {'plan':<21} {'measured MiB':>12} {'predicted MiB':>14} {'error':>8}"]
    for r in rows:
        error = r.get("prediction_error")
        err = f"{100 * error:+7.1f}%" if isinstance(error, float) else f"{'n/a':>8}"
        lines.append(f"  {r['group_size']:>4}  {column_label(str(r['plan']), _checkpoint_of(r)):<21} "
                     f"{float(r['peak_bytes']) / MIB:>12.1f} "
                     f"{float(r['predicted_step_bytes']) / MIB:>14.1f} {err}")
    return "\n".join(lines)


# ---------------------------------------------------------------- summarising


def _ok(results: list[dict[str, Any]], plan: str, group_size: int,
        checkpoint: str = "none") -> dict[str, Any] | None:
    for r in results:
        if (r["plan"] == plan and r["group_size"] == group_size and _checkpoint_of(r) == checkpoint
                and r.get("status") == "ok"):
            return r
    return None


def _ratio(results: list[dict[str, Any]], key: str, num: str, den: str, g: int) -> float | None:
    a, b = _ok(results, num, g), _ok(results, den, g)
    if a is None or b is None or not b[key]:
        return None
    if key == "peak_bytes" and min(float(a[key]), float(b[key])) < PEAK_RESOLUTION:
        return None
    return float(a[key]) / float(b[key])


def reference_group_size(group_sizes: list[int]) -> int | None:
    """The G the plan ratios are taken at: the largest G <= 8 (B1 reports G=8), else the smallest G."""
    if not group_sizes:
        return None
    small = [g for g in group_sizes if g <= 8]
    return max(small) if small else min(group_sizes)


def compute_ratios(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Plan ratios at the reference G and the detach/exact peak growth from the smallest to the largest G, both
    on the runs without activation checkpointing; when runs with and without it are both present, per plan
    `peak_<plan>_ckpt_over_plain` (checkpointed peak / plain peak at the reference G).

    A ratio whose two configurations are not both ok is None. Growth uses the smallest and largest G that
    succeeded for that plan; `from_g`/`to_g` say which.
    """
    g_ref = reference_group_size(sorted({int(r["group_size"]) for r in results}))
    ratios: dict[str, Any] = {"group_size": g_ref}
    pairs = [
        ("peak_standard_batched_over_detach", "peak_bytes", "standard_batched", "detach"),
        ("peak_standard_batched_over_exact", "peak_bytes", "standard_batched", "exact"),
        ("peak_standard_over_detach", "peak_bytes", "standard", "detach"),
        ("time_standard_over_detach", "time_s", "standard", "detach"),
        ("time_standard_over_exact", "time_s", "standard", "exact"),
        ("time_exact_over_detach", "time_s", "exact", "detach"),
    ]
    for name, key, num, den in pairs:
        ratios[name] = None if g_ref is None else _ratio(results, key, num, den, g_ref)
    if {"none", "layers"} <= {_checkpoint_of(r) for r in results}:
        for plan in dict.fromkeys(str(r["plan"]) for r in results if _checkpoint_of(r) == "layers"):
            plain = None if g_ref is None else _ok(results, plan, g_ref)
            ckpt = None if g_ref is None else _ok(results, plan, g_ref, "layers")
            plain_peak = 0.0 if plain is None else float(plain["peak_bytes"])
            ratio = (float(ckpt["peak_bytes"]) / plain_peak
                     if ckpt is not None and plain_peak >= PEAK_RESOLUTION <= float(ckpt["peak_bytes"]) else None)
            ratios[f"peak_{plan}_ckpt_over_plain"] = ratio
    growth: dict[str, Any] = {}
    for plan in ("detach", "exact"):
        ok = sorted((int(r["group_size"]), r) for r in results
                    if r["plan"] == plan and _checkpoint_of(r) == "none" and r.get("status") == "ok")
        if len(ok) < 2 or float(ok[0][1]["peak_bytes"]) < PEAK_RESOLUTION:
            growth[plan] = None
            continue
        (g_min, lo), (g_max, hi) = ok[0], ok[-1]
        pct = 100.0 * (float(hi["peak_bytes"]) - float(lo["peak_bytes"])) / float(lo["peak_bytes"])
        growth[plan] = {"from_g": g_min, "to_g": g_max, "pct": pct}
    ratios["peak_growth"] = growth
    return ratios


FLAT_PCT = 5.0  # a replay plan's peak may grow this much (%) from the smallest G to the largest


def checks(document: dict[str, Any]) -> dict[str, Any]:
    """B1's claims on a results file (its `ratios`), each with `ok` (None where the rows it needs did not run):

    * replay_flat_in_g: detach's and exact's peaks (no activation checkpointing) grow at most FLAT_PCT % from the
      smallest G to the largest;
    * replay_below_standard: at the reference G, standard_batched's peak is above detach's and exact's."""
    ratios = document.get("ratios") or compute_ratios(document["results"])
    growth = {plan: value for plan, value in ratios["peak_growth"].items() if value is not None}
    flat = {"ok": all(v["pct"] <= FLAT_PCT for v in growth.values()) if growth else None, "tolerance_pct": FLAT_PCT,
            "growth": growth}
    below = {plan: ratios.get(f"peak_standard_batched_over_{plan}") for plan in ("detach", "exact")}
    measured = [r for r in below.values() if r is not None]
    return {"replay_flat_in_g": flat,
            "replay_below_standard": {"ok": all(r > 1 for r in measured) if measured else None,
                                      "group_size": ratios.get("group_size"), "standard_batched_over": below}}


def format_table(results: list[dict[str, Any]], groups: tuple[int, ...] | list[int],
                 plans: tuple[str, ...] | list[str], checkpoints: tuple[str, ...] | list[str] = ("none",)) -> str:
    """Rows G, one column per (plan, checkpoint) labelled `plan` or `plan+ckpt` (peak MiB, step s); FAILED
    where a configuration failed, - if not run."""
    columns = [(m, c) for m in plans for c in checkpoints]
    labels = [column_label(m, c) for m, c in columns]
    width = max(19, *(len(label) for label in labels))
    head = "   G |" + "|".join(f" {label:<{width}} " for label in labels)
    sub = "     |" + "|".join(f" {'peak MiB':>10}{'time s':>{width - 10}} " for _ in labels)
    rows = [head.rstrip(), sub.rstrip(), "-" * len(sub.rstrip())]
    for g in groups:
        cells = []
        for m, c in columns:
            r = next((x for x in results if x["plan"] == m and x["group_size"] == g and _checkpoint_of(x) == c),
                     None)
            if r is None:
                cell = f"{'-':>{width}}"
            elif r.get("status") != "ok":
                cell = f"{'FAILED':>{width}}"
            else:
                cell = f"{peak_text(float(r['peak_bytes']), 10)}{r['time_s']:>{width - 10}.2f}"
            cells.append(f" {cell} ")
        rows.append((f"{g:>4} |" + "|".join(cells)).rstrip())
    return "\n".join(rows)


def format_ratios(ratios: dict[str, Any]) -> str:
    def num(x: object, suffix: str = "x") -> str:
        return "n/a (a configuration failed or was not run, or a peak is under 1 MiB)" if x is None else (
            f"{x:.2f}{suffix}")

    lines = [f"ratios at G={ratios['group_size']}:"]
    labels = [
        ("peak_standard_batched_over_detach", "peak standard_batched / detach"),
        ("peak_standard_batched_over_exact", "peak standard_batched / exact"),
        ("peak_standard_over_detach", "peak standard / detach"),
        ("time_standard_over_detach", "time standard / detach"),
        ("time_standard_over_exact", "time standard / exact"),
        ("time_exact_over_detach", "time exact / detach"),
    ]
    lines += [f"  {label:<32} {num(ratios.get(key))}" for key, label in labels]
    for key, value in ratios.items():
        if key.startswith("peak_") and key.endswith("_ckpt_over_plain"):
            plan = key[len("peak_"):-len("_ckpt_over_plain")]
            lines.append(f"  {f'peak {plan}+ckpt / {plan}':<32} {num(value)}")
    for plan, floor in (ratios.get("flop_floor") or {}).items():
        if floor is not None:
            wall, cpu = ratios["share_of_flop_floor"][plan], ratios["cpu_share_of_flop_floor"][plan]
            lines.append(f"  {f'FLOP floor standard / {plan}':<32} {floor:.2f}x: time reaches "
                         f"{num(wall, '')}, CPU time {num(cpu, '')} of it")
    lines.append("peak growth, smallest to largest G:")
    for plan, g in (ratios.get("peak_growth") or {}).items():
        text = ("n/a (under two ok configurations, or a peak under 1 MiB)" if g is None
                else f"{g['pct']:+.1f}%  (G={g['from_g']} -> G={g['to_g']})")
        lines.append(f"  {plan:<32} {text}")
    return "\n".join(lines)


# ---------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m benchmarks memory`. Unset options take the profile's value (B1 by default)."""
    profile = parser.add_mutually_exclusive_group()
    profile.add_argument("--demo", action="store_true",
                         help="B1 at G in {2, 8} only; under 2 min on 2 idle CPU cores")
    profile.add_argument("--smoke", action="store_true",
                         help="tiny-llama, P=64, R=8, G in {2, 4}; seconds (used by the tests)")
    parser.add_argument("--model", help=f"a preset ({', '.join(PRESET_NAMES)}), a local directory or a Hugging "
                                        f"Face id (default {B1.model})")
    parser.add_argument("--arch", help=f"architecture family, one of {', '.join(B1_ARCHS)}: runs its b1-<arch> "
                                       "preset (llama = b1-llama)")
    parser.add_argument("--prompt-tokens", type=positive_int, help=f"P (default {B1.prompt_tokens})")
    parser.add_argument("--response-tokens", type=positive_int,
                        help=f"R, every response (default {B1.response_tokens})")
    parser.add_argument("--turns", type=positive_int, help="multi-turn groups: turns per response (default 1)")
    parser.add_argument("--observation-tokens", type=positive_int, metavar="O",
                        help="multi-turn groups: observation tokens after each turn's R generated ones, masked from "
                             "the loss (an agent's tool results)")
    parser.add_argument("--groups", type=positive_int, nargs="+", metavar="G",
                        help=f"group sizes (default {' '.join(map(str, B1.groups))})")
    parser.add_argument("--plans", nargs="+", choices=PLANS, metavar="PLAN", dest="plans",
                        help=f"plans, of {', '.join(PLANS)} (default all four)")
    checkpoint = parser.add_mutually_exclusive_group()
    checkpoint.add_argument("--checkpoint", nargs="+", choices=CHECKPOINT_CHOICES, metavar="MODE",
                            help="activation checkpointing, measured side by side: none, layers or both "
                                 "(default none)")
    checkpoint.add_argument("--checkpoint-layers", action="store_true",
                            help="shorthand for --checkpoint layers")
    parser.add_argument("--offload-state", action="store_true", default=None,
                        help="detach/exact: keep the prompt state in host memory, one layer's part on the device")
    parser.add_argument("--max-positions", type=positive_int, metavar="N",
                        help="override the model's max_position_embeddings, to measure memory and time past the "
                             "context it was trained for (RoPE extrapolates; no quality is claimed)")
    parser.add_argument("--warm-steps", type=positive_int, metavar="N",
                        help="N more steps after the measured cold one, in the same process; the fastest is the "
                             "time (the peak stays the cold step's, the cold time is kept as first_step)")
    parser.add_argument("--chunk-size", type=positive_int,
                        help=f"prompt capture chunk (default {B1.chunk_size})")
    parser.add_argument("--micro-batch", type=positive_int,
                        help=f"responses replayed at once (default {B1.micro_batch})")
    parser.add_argument("--dtype", choices=DTYPES,
                        help=f"parameter dtype (default {B1.dtype})")
    parser.add_argument("--device", help="cpu or cuda[:i] (default cpu); CUDA peak is max_memory_allocated")
    parser.add_argument("--seed", type=int, help="seed of the random group (default 0)")
    parser.add_argument("--timeout", type=positive_float, metavar="SECONDS",
                        help="per-configuration limit; a configuration over it is recorded as failed")
    parser.add_argument("--malloc-mmap-threshold", type=non_negative_int, metavar="BYTES",
                        help="glibc mmap threshold for the workers (default 131072, which makes peaks "
                             "repeatable); 0 keeps glibc's dynamic threshold")
    parser.add_argument("--out", help="result JSON (default bench/results/memory-<YYYYmmdd-HHMMSS>.json)")


def config_from_args(args: argparse.Namespace, fail: Callable[[str], NoReturn]) -> MemoryBenchConfig:
    """The profile (--smoke, --demo or B1) with every explicitly given option applied on top.

    fail: reports a bad combination and exits (the subcommand parser's `error`).
    """
    config = SMOKE if args.smoke else DEMO if args.demo else B1
    overrides = {
        "model": args.model, "dtype": args.dtype, "device": args.device,
        "prompt_tokens": args.prompt_tokens, "response_tokens": args.response_tokens,
        "turns": getattr(args, "turns", None), "observation_tokens": getattr(args, "observation_tokens", None),
        "chunk_size": args.chunk_size, "micro_batch": args.micro_batch,
        "offload_state": getattr(args, "offload_state", None), "max_positions": getattr(args, "max_positions", None),
        "seed": args.seed, "timeout_s": args.timeout, "malloc_mmap_threshold": args.malloc_mmap_threshold,
        "warm_steps": getattr(args, "warm_steps", None),
        # Duplicates would only re-measure a configuration; keep the order given.
        "groups": tuple(dict.fromkeys(args.groups)) if args.groups else None,
        "plans": tuple(dict.fromkeys(args.plans)) if args.plans else None,
        "checkpoints": ("layers",) if getattr(args, "checkpoint_layers", False)
        else tuple(dict.fromkeys(args.checkpoint)) if getattr(args, "checkpoint", None) else None,
    }
    if getattr(args, "arch", None):
        if args.model:
            fail("give --model or --arch, not both")
        try:
            overrides["model"] = arch_preset(args.arch)
        except ValueError as err:
            fail(str(err))
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if config.prompt_tokens < 2:
        fail("--prompt-tokens must be >= 2 (detach/exact capture all but the last prompt token)")
    check_device(config.device, fail)
    check_model(config.model, fail)
    return config


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of `python -m benchmarks memory`: exit status 0 if at least one configuration succeeded."""
    check_out(args.out, args.fail)
    config = config_from_args(args, args.fail)
    out = args.out or default_out("memory", config.smoke)
    document = run_memory_bench(config, out)
    ok = sum(1 for r in document["results"] if r.get("status") == "ok")
    if ok == 0:
        print(f"bench memory: every configuration failed; see stderr_tail in {out}.tmp", file=sys.stderr)
        return 1
    return 0


BENCHMARKS = (
    Benchmark(
        name="memory", help="peak memory and step time of every plan across group sizes (Bench B1)",
        description="Bench B1: each (plan, G) in a fresh process; peak memory, step time, plan ratios.",
        add_arguments=add_arguments, run=run_from_args, checks=checks,
    ),
)
