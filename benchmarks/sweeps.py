"""`python -m benchmarks prompt | pareto | arch`: the sweeps beside Bench B1 (`benchmarks/memory.py`).

* prompt — P = 1k, 2k, … at fixed (R, G): peak and step time per plan; a plan stops at its first P whose
  measured peak exceeds `--budget` (or that fails). A configuration the planner predicts above the budget
  by more than its tolerance, or above the memory this machine has free, is skipped, not run: the sweep must
  not OOM a shared host.
* pareto — fixed (P, R, G): time vs peak over micro-batch × chunk size × the memory levers (per-layer
  activation checkpointing, the prompt state offloaded to host memory) for detach and exact, with each plan's
  Pareto front and the levers' cost: `benchmarks/pareto.py` (its options and dispatch are here).
* arch — Bench B1's comparison for every architecture family that has a `b1-<arch>` preset in
  `longstraw.models` (found by name, so families added later are picked up without changes here).

Every configuration runs in a fresh worker (`benchmarks/worker.py`, through `benchmarks/common.py`) exactly as
`bench memory` does; `--smoke` runs a tiny version of each in one worker process. Results: a JSON document
(config, machine, results, summary) under `bench/results/`, a printed table, a PNG beside the JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NoReturn

from benchmarks.common import (
    B1_ARCHS,
    GIB,
    MIB,
    PLANNER_SLACK,
    arch_preset,
    available_archs,
    check_device,
    check_model,
    check_out,
    default_out,
    finish_sweep,
    job_config,
    positive_float,
    predictor,
    print_progress,
    run_batch,
    smoke_preset,
    sweep_document,
    write_json,
)
from benchmarks.memory import compute_ratios, format_ratios, format_table
from benchmarks.pareto import OFFLOAD_CHOICES, PARETO_SMOKE, ParetoBenchConfig, run_pareto_bench
from benchmarks.registry import Benchmark
from longstraw.choices import CHECKPOINT_CHOICES, DTYPES, PLANS, PLANS_BASELINE_FIRST, PRESET_NAMES
from longstraw.planner import non_negative_int, positive_int

# ---------------------------------------------------------------- configs


@dataclass(frozen=True)
class PromptBenchConfig:
    """Prompt-length sweep. Defaults: b1-llama, fp32, R=256, G=4, P = 1k … 128k, budget 16 GiB."""

    model: str = "b1-llama"
    dtype: str = "float32"
    device: str = "cpu"
    prompts: tuple[int, ...] = tuple(1024 * 2**i for i in range(8))
    response_tokens: int = 256
    group_size: int = 4
    plans: tuple[str, ...] = PLANS_BASELINE_FIRST
    chunk_size: int = 2048
    micro_batch: int = 1
    budget_bytes: int = 16 * GIB
    seed: int = 0
    timeout_s: float | None = None
    malloc_mmap_threshold: int = 128 * 1024
    isolate: bool = True
    smoke: bool = False  # --smoke: report only that every configuration ran


@dataclass(frozen=True)
class ArchBenchConfig:
    """B1 (P=4096, R=256, all plans) at G in {2, 8} on every `b1-<arch>` preset (archs empty: all of them)."""

    archs: tuple[str, ...] = ()
    dtype: str = "float32"
    device: str = "cpu"
    prompt_tokens: int = 4096
    response_tokens: int = 256
    groups: tuple[int, ...] = (2, 8)
    plans: tuple[str, ...] = PLANS_BASELINE_FIRST
    chunk_size: int = 2048
    micro_batch: int = 1
    seed: int = 0
    timeout_s: float | None = None
    malloc_mmap_threshold: int = 128 * 1024
    isolate: bool = True
    smoke: bool = False  # tiny-<arch> presets where they exist


PROMPT_SMOKE = PromptBenchConfig(model="tiny-llama", prompts=(64, 128), response_tokens=8, group_size=2,
                                 chunk_size=32, budget_bytes=GIB, isolate=False, smoke=True)
# Smoke: the exact plan only (capture, replay and prompt backward) on every family, so the smoke stays cheap as
# families are added; the other plans' smoke is `bench memory --smoke`.
ARCH_SMOKE = ArchBenchConfig(prompt_tokens=64, response_tokens=8, groups=(2,), plans=("exact",), chunk_size=32,
                             isolate=False, smoke=True)


def _table(results: list[dict], row_key: str, row_label: str, rows: list, plans: tuple[str, ...]) -> str:
    """Rows of `row_key` values, two columns per plan: peak MiB, step s (skipped/FAILED where so)."""
    width = 19
    head = f"{row_label:>9} |" + "|".join(f" {m:<{width}} " for m in plans)
    sub = f"{'':>9} |" + "|".join(f" {'peak MiB':>10}{'time s':>{width - 10}} " for _ in plans)
    lines = [head.rstrip(), sub.rstrip(), "-" * len(sub.rstrip())]
    for value in rows:
        cells = []
        for plan in plans:
            hit = [r for r in results if r[row_key] == value and r["plan"] == plan]
            if not hit:
                cells.append(f" {'-':>10}{'-':>{width - 10}} ")
            elif hit[0]["status"] == "ok":
                cells.append(f" {hit[0]['peak_bytes'] / MIB:>10.1f}{hit[0]['time_s']:>{width - 10}.2f} ")
            else:
                word = "skipped" if hit[0]["status"] == "skipped" else "FAILED"
                cells.append(f" {word:>{width}} ")
        lines.append(f"{value:>9} |" + "|".join(cells))
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---------------------------------------------------------------- prompt


def run_prompt_bench(cfg: PromptBenchConfig, out: str) -> dict[str, Any]:
    """P ascending; each still-active plan runs at each P; a plan stops after its first P over the budget."""
    document = sweep_document("prompt", cfg, cfg.device)
    results: list[dict] = document["results"]
    predict = predictor(cfg.model, cfg.dtype)
    available = _available_bytes() if cfg.device == "cpu" else None
    active = list(cfg.plans)
    print(f"bench prompt: {cfg.model} {cfg.dtype}, R={cfg.response_tokens} G={cfg.group_size}, P in "
          f"{list(cfg.prompts)}, budget {_size(cfg.budget_bytes)}", file=sys.stderr)
    for p in cfg.prompts:
        jobs, skipped = [], []
        for plan in active:
            predicted = predict(p, cfg.response_tokens, cfg.group_size, plan, cfg.chunk_size,
                                cfg.micro_batch) if predict else None
            entry: dict[str, Any] = {"plan": plan, "group_size": cfg.group_size, "prompt_tokens": p,
                                     "predicted_step_bytes": predicted}
            too_big = predicted is not None and predicted > cfg.budget_bytes * (1 + PLANNER_SLACK)
            no_room = predicted is not None and available is not None and predicted > 0.8 * available
            if too_big or no_room:
                assert predicted is not None  # both need a prediction
                why = "the budget" if too_big else "80% of this machine's available memory"
                entry.update(status="skipped", error=f"planner predicts {predicted / MIB:.0f} MiB, over {why}")
                skipped.append(entry)
            else:
                jobs.append((entry, plan))
        ran = run_batch([(job_config(cfg, cfg.model, p, cfg.chunk_size, cfg.micro_batch), plan, cfg.group_size)
                         for _, plan in jobs], isolate=cfg.isolate)
        for (entry, _), measured in zip(jobs, ran):
            entry.update(measured)
            entry["prompt_tokens"] = p
            entry["over_budget"] = entry["status"] == "ok" and entry["peak_bytes"] > cfg.budget_bytes
        for entry in [e for e, _ in jobs] + skipped:
            results.append(entry)
            print_progress(len(results), entry, f"P={p}")
            if entry["status"] != "ok" or entry.get("over_budget"):
                active.remove(entry["plan"])
        write_json(out + ".tmp", document)
        if not active:
            break
    document["summary"] = prompt_summary(results, cfg)
    table = _table(results, "prompt_tokens", "P", list(cfg.prompts), cfg.plans) + "\n" + _prompt_lines(
        document["summary"])
    from benchmarks.plots import plot_prompt

    finish_sweep(document, out, table, plot_prompt, cfg.smoke)
    return document


def prompt_summary(results: list[dict], cfg: PromptBenchConfig) -> dict[str, Any]:
    """Per plan: the largest P measured within the budget and the first P that was over it, failed or skipped."""
    summary: dict[str, Any] = {"budget_bytes": cfg.budget_bytes}
    for plan in cfg.plans:
        mine = sorted((r for r in results if r["plan"] == plan), key=lambda r: r["prompt_tokens"])
        within = [r["prompt_tokens"] for r in mine if r["status"] == "ok" and not r["over_budget"]]
        beyond = [r for r in mine if r["status"] != "ok" or r.get("over_budget")]
        summary[plan] = {
            "largest_within_budget": max(within) if within else None,
            "stopped_at": beyond[0]["prompt_tokens"] if beyond else None,
            "stopped_because": (beyond[0].get("error") or "over budget") if beyond else None,
        }
    return summary


def _prompt_lines(summary: dict) -> str:
    lines = [f"budget {_size(summary['budget_bytes'])}:"]
    for plan, s in summary.items():
        if plan == "budget_bytes":
            continue
        stop = f", stopped at P={s['stopped_at']} ({s['stopped_because']})" if s["stopped_at"] else ""
        lines.append(f"  {plan:<17} largest P within budget: {s['largest_within_budget']}{stop}")
    return "\n".join(lines)


# ---------------------------------------------------------------- arch


def run_arch_bench(cfg: ArchBenchConfig, out: str) -> dict[str, Any]:
    """Every (arch, G, plan) at the B1 shape; ratios per arch as `bench memory` computes them."""
    archs = list(cfg.archs) or available_archs()
    document = sweep_document("arch", cfg, cfg.device)
    results: list[dict] = document["results"]
    print(f"bench arch: {', '.join(archs)}; P={cfg.prompt_tokens} R={cfg.response_tokens} G in {list(cfg.groups)}",
          file=sys.stderr)
    jobs = []  # (arch, model, job config, plan, G)
    for arch in archs:
        model = smoke_preset(arch) if cfg.smoke else arch_preset(arch)
        job_cfg = job_config(cfg, model, cfg.prompt_tokens, cfg.chunk_size, cfg.micro_batch)
        jobs += [(arch, model, job_cfg, plan, g) for g in cfg.groups for plan in cfg.plans]
    # isolate: a fresh worker per configuration; smoke: one worker for every family's configurations
    batches = [[job] for job in jobs] if cfg.isolate else [jobs]
    for batch in batches:
        measured = run_batch([(c, plan, g) for _, _, c, plan, g in batch], isolate=cfg.isolate)
        for (arch, model, _, _, g), entry in zip(batch, measured):
            entry.update(arch=arch, model=model)
            results.append(entry)
            print_progress(len(results), entry, f"{arch} G={g}")
        write_json(out + ".tmp", document)
    tables, ratios = [], {}
    for arch in archs:
        mine = [r for r in results if r["arch"] == arch]
        ratios[arch] = compute_ratios(mine)
        tables.append(f"{arch} ({mine[0]['model']})\n{format_table(mine, cfg.groups, cfg.plans)}\n"
                      f"{format_ratios(ratios[arch])}")
    document["ratios"] = ratios
    from benchmarks.plots import plot_arch

    finish_sweep(document, out, "\n\n".join(tables), plot_arch, cfg.smoke)
    return document


# ---------------------------------------------------------------- command line


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one worker process; seconds")
    parser.add_argument("--dtype", choices=DTYPES, help="default float32")
    parser.add_argument("--device", help="cpu or cuda[:i] (default cpu); CUDA peak is max_memory_allocated")
    parser.add_argument("--seed", type=int, help="seed of the random group (default 0)")
    parser.add_argument("--timeout", type=positive_float, metavar="SECONDS", help="per-configuration limit")
    parser.add_argument("--malloc-mmap-threshold", type=positive_int, metavar="BYTES",
                        help="glibc mmap threshold for the workers (default 131072)")
    parser.add_argument("--out", help="result JSON (default bench/results/<bench>-<YYYYmmdd-HHMMSS>.json)")


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    d = PromptBenchConfig()
    parser.add_argument("--model", help=f"a preset ({', '.join(PRESET_NAMES)}), a local directory or a Hugging "
                                        f"Face id (default {d.model})")
    parser.add_argument("--prompts", type=positive_int, nargs="+", metavar="P",
                        help=f"prompt lengths (default {' '.join(map(str, d.prompts))})")
    parser.add_argument("--response-tokens", type=positive_int, help=f"R (default {d.response_tokens})")
    parser.add_argument("--group-size", type=positive_int, help=f"G (default {d.group_size})")
    parser.add_argument("--plans", nargs="+", choices=PLANS, metavar="PLAN", dest="plans",
                        help=f"plans, of {', '.join(PLANS)} (default all four)")
    parser.add_argument("--chunk-size", type=positive_int, help=f"prompt chunk (default {d.chunk_size})")
    parser.add_argument("--micro-batch", type=positive_int, help="responses replayed at once (default 1)")
    parser.add_argument("--budget", help="memory budget per step, e.g. 16GiB (default 16GiB)")


def add_pareto_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    d = ParetoBenchConfig()
    parser.add_argument("--model", help=f"a preset ({', '.join(PRESET_NAMES)}), a local directory or a Hugging "
                                        f"Face id (default {d.model})")
    parser.add_argument("--prompt-tokens", type=positive_int, help=f"P (default {d.prompt_tokens})")
    parser.add_argument("--response-tokens", type=positive_int, help=f"R (default {d.response_tokens})")
    parser.add_argument("--group-size", type=positive_int, help=f"G (default {d.group_size})")
    parser.add_argument("--plans", nargs="+", choices=("detach", "exact"), metavar="PLAN", dest="plans",
                        help="detach and/or exact (default both)")
    parser.add_argument("--micro-batches", type=positive_int, nargs="+", metavar="K",
                        help=f"default {' '.join(map(str, d.micro_batches))}")
    parser.add_argument("--chunk-sizes", type=positive_int, nargs="+", metavar="C",
                        help=f"default {' '.join(map(str, d.chunk_sizes))}")
    parser.add_argument("--checkpoint", nargs="+", choices=CHECKPOINT_CHOICES,
                        help="per-layer activation checkpointing, each setting a grid of its own: none, layers or "
                             f"both (default {' '.join(d.checkpoints)})")
    parser.add_argument("--offload", nargs="+", choices=tuple(OFFLOAD_CHOICES),
                        help="prompt state offloaded to host memory (backward_group(offload_state=True)), each "
                             "setting a grid of its own: no, yes or both (default no yes); yes runs for detach and "
                             "exact only")
    parser.add_argument("--keep-prompt-graph", type=non_negative_int, nargs="+", metavar="N", dest="keeps",
                        help="exact only: capture chunks whose graph is kept for the prompt backward "
                             "(backward_group(keep_prompt_graph=N)), each a grid of its own (default 0)")


def add_arch_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser)
    d = ArchBenchConfig()
    parser.add_argument("--archs", nargs="+", metavar="ARCH",
                        help=f"families, of {', '.join(B1_ARCHS)} (default every b1-<arch> preset)")
    parser.add_argument("--list", action="store_true", help="print the available architectures and exit")
    parser.add_argument("--prompt-tokens", type=positive_int, help=f"P (default {d.prompt_tokens})")
    parser.add_argument("--response-tokens", type=positive_int, help=f"R (default {d.response_tokens})")
    parser.add_argument("--groups", type=positive_int, nargs="+", metavar="G",
                        help=f"default {' '.join(map(str, d.groups))}")
    parser.add_argument("--plans", nargs="+", choices=PLANS, metavar="PLAN", dest="plans",
                        help=f"plans, of {', '.join(PLANS)} (default all four)")
    parser.add_argument("--chunk-size", type=positive_int, help=f"default {d.chunk_size}")
    parser.add_argument("--micro-batch", type=positive_int, help="default 1")


def _overrides(args: argparse.Namespace, names: dict[str, str]) -> dict[str, Any]:
    """Explicitly given options as config fields (lists become de-duplicated tuples)."""
    out: dict[str, Any] = {}
    for arg, field_name in names.items():
        value = getattr(args, arg, None)
        if value is None:
            continue
        out[field_name] = tuple(dict.fromkeys(value)) if isinstance(value, list) else value
    return out


_COMMON = {"dtype": "dtype", "device": "device", "seed": "seed", "timeout": "timeout_s",
           "malloc_mmap_threshold": "malloc_mmap_threshold"}


def config_from_args(args: argparse.Namespace, fail: Callable[[str], NoReturn]):
    """The bench's config (smoke or default) with explicit options applied; bad input -> fail(message)."""
    from longstraw.planner import parse_size

    cfg: PromptBenchConfig | ParetoBenchConfig | ArchBenchConfig
    if args.bench == "prompt":
        cfg = PROMPT_SMOKE if args.smoke else PromptBenchConfig()
        names = {**_COMMON, "model": "model", "prompts": "prompts", "response_tokens": "response_tokens",
                 "group_size": "group_size", "plans": "plans", "chunk_size": "chunk_size", "micro_batch": "micro_batch"}
        over = _overrides(args, names)
        if args.budget:
            try:
                over["budget_bytes"] = parse_size(args.budget)
            except ValueError as err:
                fail(str(err))
        if "prompts" in over:
            over["prompts"] = tuple(sorted(over["prompts"]))
            if min(over["prompts"]) < 2:
                fail("--prompts must all be >= 2")
        cfg = replace(cfg, **over)
    elif args.bench == "pareto":
        cfg = PARETO_SMOKE if args.smoke else ParetoBenchConfig()
        names = {**_COMMON, "model": "model", "prompt_tokens": "prompt_tokens", "response_tokens": "response_tokens",
                 "group_size": "group_size", "plans": "plans", "micro_batches": "micro_batches",
                 "chunk_sizes": "chunk_sizes", "checkpoint": "checkpoints", "keeps": "keeps"}
        over = _overrides(args, names)
        if getattr(args, "offload", None):
            over["offloads"] = tuple(dict.fromkeys(OFFLOAD_CHOICES[w] for w in args.offload))
        cfg = replace(cfg, **over)
        # The profile's extra configurations stay only where they fit the grid asked for (and --offload decides
        # the offloading on its own).
        cfg = replace(cfg, extra=() if "offloads" in over or "keeps" in over else tuple(
            x for x in cfg.extra if x[0] in cfg.plans and x[1] in cfg.micro_batches and x[2] in cfg.chunk_sizes
            and x[3] in cfg.checkpoints))
        if cfg.prompt_tokens < 2:
            fail("--prompt-tokens must be >= 2")
    elif args.bench == "arch":
        cfg = ARCH_SMOKE if args.smoke else ArchBenchConfig()
        names = {**_COMMON, "archs": "archs", "prompt_tokens": "prompt_tokens", "response_tokens": "response_tokens",
                 "groups": "groups", "plans": "plans", "chunk_size": "chunk_size", "micro_batch": "micro_batch"}
        cfg = replace(cfg, **_overrides(args, names))
        for arch in cfg.archs:
            try:
                arch_preset(arch)
            except ValueError as err:
                fail(str(err))
        if cfg.prompt_tokens < 2:
            fail("--prompt-tokens must be >= 2")
    else:
        fail(f"unknown bench {args.bench!r}")
    check_device(cfg.device, fail)
    if not isinstance(cfg, ArchBenchConfig):
        check_model(cfg.model, fail)
    return cfg


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of `python -m benchmarks prompt|pareto|arch`: exit 0 if at least one configuration succeeded."""
    check_out(args.out, args.fail)
    if args.bench == "arch" and args.list:
        print("\n".join(f"{a}\t{arch_preset(a)}" for a in available_archs()))
        return 0
    cfg = config_from_args(args, args.fail)
    out = args.out or default_out(args.bench, cfg.smoke)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    if args.bench == "prompt":
        document = run_prompt_bench(cfg, out)
    elif args.bench == "pareto":
        document = run_pareto_bench(cfg, out)
    else:
        document = run_arch_bench(cfg, out)
    if not any(r.get("status") == "ok" for r in document["results"]):
        print(f"bench {args.bench}: no configuration ran successfully (failed: see stderr_tail; skipped: see "
              f"error) in {out}", file=sys.stderr)
        return 1
    return 0


BENCHMARKS = (
    Benchmark(
        name="prompt", help="prompt-length sweep at fixed G: where each plan leaves a memory budget, time vs P",
        description="Each (plan, P) in a fresh process; a plan stops at the first P over --budget.",
        add_arguments=add_prompt_arguments, run=run_from_args,
    ),
    Benchmark(
        name="pareto", help="time vs peak memory over micro-batch and chunk size for detach and exact",
        description="Fixed (P, R, G); every (plan, micro_batch, chunk_size) in a fresh process; Pareto front.",
        add_arguments=add_pareto_arguments, run=run_from_args,
    ),
    Benchmark(
        name="arch", help="the B1 shape on every architecture with a b1-<arch> preset",
        description="Bench B1's comparison (all plans) for each architecture family's b1-<arch> preset.",
        add_arguments=add_arch_arguments, run=run_from_args,
    ),
)
