"""`python -m benchmarks tree`: a synthetic agent mini-batch shaped like tau^2-bench (`planner.tree.TreeShape`: a shared
system prompt + tools of S tokens, K tasks of C tokens, G trajectories per task of T turns, each turn r response
tokens in the loss and o observation tokens masked out, branching B ways at the last log_B(G) turns) run five ways,
each row in a fresh `benchmarks/tree_worker.py` process on the same weights and tokens:

* flattened: every trajectory through the model as one full sequence (what TRL and verl do);
* group: LongStraw per task (`backward_group`, plan exact, the task's S + C tokens as the group prompt: today's path);
* packed: the whole tree once in one sequence with an ancestor attention mask (the peers' approach);
* tree_exact, tree_detach: LongStraw's `backward_tree`.

Each row runs twice, as `bench peers` runs a configuration: a peak run under glibc's fixed mmap threshold (as every
bench: peaks repeat within 1 MiB, `common.py`) and a timing run under glibc's default allocator, what users run
(under the fixed threshold every allocation above 128 KiB is a fresh mmap, page-faulted on first touch, which charges
the plans that make more, smaller allocations: the tree's many node and leaf backwards, each with its (V, d)
embedding and head gradients). Per row: peak step memory (VmHWM above the loaded model) from the peak run, wall and
CPU time of the step and CPU pressure from the timing run (the peak run's under `time_fixed_threshold_s`), its
token-pass floor
(`planner.tree.token_passes`) and floor ratio (flattened's passes / the row's), its measured time ratio (flattened's
time / the row's at the same K and G), and for flattened and tree_exact the planner's forecast (`planner.tree.forecast`)
with its error. K and G are swept: by default along two axes through the middle values (every K at the middle G,
every G at the middle K; `--grid full` runs every pair). Then the checks of docs/trees.md's bench line (`checks`):
tree_exact's peak below every other row, flat (within 5%) as G doubles, its time ratio at least 0.8x its floor
ratio, and the packed row's peak growing with the tree.

Shapes (`--shape`, `SHAPES`; every option overrides the shape's value):

* tau (default): tau^2-bench, trajectories branching 2 ways at the last log_2(G) turns; every row, K 1, 2, 4 and
  G 2, 4, 8;
* trl-async: the batches of TRL's (async) GRPO trainer: one shared system prompt, K prompts, G samples per prompt
  that are independent multi-turn conversations forking G ways at their first response (`TreeShape.fork` "first":
  the rollout worker samples G completions per prompt), each turn r response tokens in the loss and o tool-result
  tokens masked out. Rows packed (TRL's tree-attention method: the ancestor mask, SDPA on CPU), tree_exact and
  flattened (for the floor ratio) at K = 2 as G doubles 2, 4, 8, 16; one torch thread per worker.
  `python -m benchmarks tree --shape trl-async` (`--smoke`: tiny-llama, seconds).

Results: bench/results/tree-<shape>-<date>.json (`--out`), the table on stdout, a plot beside the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks.common import (
    B1,
    MIB,
    PEAK_RESOLUTION,
    STDERR_TAIL,
    TIMING_THRESHOLD,
    busy,
    check_device,
    check_model,
    check_out,
    combine_runs,
    finish_sweep,
    non_negative_int,
    peak_text,
    positive_float,
    print_progress,
    sweep_document,
    write_json,
)
from benchmarks.flops import NOTE as FLOP_NOTE
from benchmarks.flops import preset_costs, tree_floors
from benchmarks.launch import describe_exit, worker_command, worker_env
from benchmarks.registry import Benchmark
from longstraw.choices import DTYPES, PRESET_NAMES
from longstraw.planner import positive_int
from longstraw.planner.tree import FLOOR_FORMULAS, FORKS, ROWS, Fork, TreeShape, counts, token_passes

FLOOR_NOTE = ("token passes: tokens run through the model's body, a backward counted as two forwards; E the tree's "
              "encoded tokens, I / L its inner nodes' / leaves' inputs, I_loss the inner nodes' inputs that predict "
              "loss-region tokens; the output projection and attention's quadratic part are not counted")

FLAT_TOLERANCE = 0.05  # tree_exact's peak may grow this much when G doubles
FLOOR_SHARE = 0.8  # tree_exact's time ratio over flattened must reach this share of its floor ratio


@dataclass(frozen=True)
class TreeBenchConfig:
    """One run of the bench: the model, the shape's per-trajectory sizes, the K and G swept, the rows."""

    name: str = "tau"  # the shape's name in the results file's name
    model: str = "b1-llama"
    dtype: str = "float32"
    device: str = "cpu"
    system_tokens: int = 1024  # S
    task_tokens: int = 128  # C
    turns: int = 4  # T
    response_tokens: int = 32  # r
    observation_tokens: int = 96  # o
    branching: int = 2  # B
    fork: Fork = "last"  # where a task's trajectories branch (`TreeShape.fork`)
    tasks: tuple[int, ...] = (1, 2, 4)  # K swept
    groups: tuple[int, ...] = (2, 4, 8)  # G swept
    grid: str = "cross"  # "cross": every K at the middle G and every G at the middle K; "full": every pair
    rows: tuple[str, ...] = ROWS
    chunk_size: int = 256
    micro_batch: int = 2  # B = 2: a node's two sibling leaves in one replay (per group: two responses)
    seed: int = 0
    threads: int = 0  # torch intra-op threads of the workers (OMP_NUM_THREADS); 0: torch's default
    warm_steps: int = 1  # steps after the cold first one; the fastest of them is timed (`benchmarks/tree_worker.py`)
    timeout_s: float | None = None
    malloc_mmap_threshold: int = B1.malloc_mmap_threshold  # the peak run's
    timing_run: bool = True  # time each row again in a process under glibc's default allocator
    smoke: bool = False


DEFAULT = TreeBenchConfig()
# --smoke: tiny-llama at a tiny shape, every row at one K and G; seconds (the tests use it).
SMOKE = replace(DEFAULT, name="smoke", model="tiny-llama", system_tokens=32, task_tokens=8, turns=2,
                response_tokens=4, observation_tokens=4, tasks=(2,), groups=(2,), chunk_size=16, threads=1,
                warm_steps=0, timing_run=False, smoke=True)
# TRL's async GRPO batches: G conversations per prompt forking at the first response, each 3 turns of 32 response +
# 32 tool-result tokens after a 1024-token system prompt and a 128-token prompt; packed against the tree (flattened
# for the floor ratio), G doubling at K = 2. One torch thread per worker, so that a second process on a 2-core host
# shares the machine without sharing a row's cores.
TRL_ASYNC = replace(DEFAULT, name="trl-async", fork="first", turns=3, response_tokens=32, observation_tokens=32,
                    tasks=(2,), groups=(2, 4, 8, 16), rows=("flattened", "packed", "tree_exact"), threads=1)
TRL_ASYNC_SMOKE = replace(TRL_ASYNC, name="trl-async-smoke", model="tiny-llama", system_tokens=32, task_tokens=8,
                          turns=2, response_tokens=4, observation_tokens=4, groups=(2, 4), chunk_size=16,
                          warm_steps=0, timing_run=False, smoke=True)
# --shape: its full run and its --smoke run
SHAPES = {"tau": (DEFAULT, SMOKE), "trl-async": (TRL_ASYNC, TRL_ASYNC_SMOKE)}


def shape_of(config: TreeBenchConfig, tasks: int, group_size: int) -> TreeShape:
    return TreeShape(system_tokens=config.system_tokens, tasks=tasks, task_tokens=config.task_tokens,
                     group_size=group_size, turns=config.turns, response_tokens=config.response_tokens,
                     observation_tokens=config.observation_tokens, branching=config.branching, fork=config.fork)


def middle(values: tuple[int, ...]) -> int:
    """The middle of the sorted values (the lower one of two middles)."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


def pairs(config: TreeBenchConfig) -> list[tuple[int, int]]:
    """The (K, G) measured, in order: every K at the middle G, then every other G at the middle K (`grid`
    "cross"), or every pair ("full")."""
    if config.grid == "full":
        return [(k, g) for k in config.tasks for g in config.groups]
    k0, g0 = middle(config.tasks), middle(config.groups)
    return [(k, g0) for k in config.tasks] + [(k0, g) for g in config.groups if g != g0]


# ---------------------------------------------------------------- running one row


def run_row(config: TreeBenchConfig, row: str, tasks: int, group_size: int) -> dict[str, Any]:
    """One row: its peak run (fixed mmap threshold) and, unless a smoke run or the peak run failed, its timing run
    (glibc's default allocator), each in a fresh `benchmarks/tree_worker.py`; the entry (`common.combine_runs`: status
    ok or failed, never raising)."""
    shape = shape_of(config, tasks, group_size)
    entry: dict[str, Any] = {"row": row, "plan": row, "tasks": tasks, "group_size": group_size,
                             "counts": asdict(counts(shape)), "token_passes": token_passes(shape, row),
                             "floor_ratio": token_passes(shape, "flattened") / token_passes(shape, row),
                             "flop_floor_ratio": flop_floor(config, shape, row)}
    payload = {"row": row, "model": config.model, "dtype": config.dtype, "device": config.device,
               "shape": asdict(shape), "chunk_size": config.chunk_size, "micro_batch": config.micro_batch,
               "seed": config.seed, "warm_steps": config.warm_steps}
    peak = {**entry, **_run_worker(config, payload, config.malloc_mmap_threshold)}
    timed = config.timing_run and peak["status"] == "ok"
    return combine_runs(peak, _run_worker(config, payload, TIMING_THRESHOLD) if timed else None)


def flop_floor(config: TreeBenchConfig, shape: TreeShape, row: str) -> float | None:
    """Flattened's FLOP count over the row's on the bench's own trajectories (`benchmarks/flops.py`); None for a
    model the count does not cover."""
    from benchmarks.tree_batch import make_trajectories
    from longstraw.models.presets import PRESETS

    c = preset_costs(config.model)
    if c is None:
        return None
    trajectories = make_trajectories(shape, PRESETS[config.model]().vocab_size, config.seed)
    return tree_floors(c, trajectories, (row,))[row]


def _run_worker(config: TreeBenchConfig, payload: dict[str, Any], mmap_threshold: int) -> dict[str, Any]:
    """One worker process under `mmap_threshold` (0: glibc's default): its measurement with status ok, or failed
    with the error and stderr's tail."""
    env = worker_env(mmap_threshold, smoke=config.smoke)
    if config.threads:
        env["OMP_NUM_THREADS"] = str(config.threads)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(worker_command("tree_worker", json.dumps(payload)),
                              capture_output=True, text=True, timeout=config.timeout_s, env=env)
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
        return {"status": "failed", "error": f"timed out after {config.timeout_s} s",
                "stderr_tail": stderr[-STDERR_TAIL:], "process_s": time.perf_counter() - t0}
    result: dict[str, Any] = {"malloc_mmap_threshold": mmap_threshold, "process_s": time.perf_counter() - t0}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        error = describe_exit(proc.returncode) if proc.returncode != 0 else "worker printed no result"
        last = proc.stderr.strip().splitlines()[-1:]
        return {**result, "status": "failed", "error": error + (f": {last[0]}" if last else ""),
                "stderr_tail": proc.stderr[-STDERR_TAIL:]}
    return {**result, "status": "ok", **json.loads(lines[-1])}


# ---------------------------------------------------------------- ratios, forecasts, checks


def _find(results: list[dict[str, Any]], row: str, tasks: int, group_size: int) -> dict[str, Any] | None:
    for r in results:
        if r["row"] == row and r["tasks"] == tasks and r["group_size"] == group_size and r.get("status") == "ok":
            return r
    return None


def add_ratios(results: list[dict[str, Any]]) -> None:
    """Per ok entry: time_ratio and cpu_time_ratio, flattened's wall / CPU time over the row's at the same K and G
    (None without an ok flattened row there)."""
    for r in results:
        if r.get("status") != "ok":
            continue
        flat = _find(results, "flattened", r["tasks"], r["group_size"])
        for key, ratio in (("time_s", "time_ratio"), ("cpu_time_s", "cpu_time_ratio"),
                           ("time_fixed_threshold_s", "time_ratio_fixed_threshold")):
            r[ratio] = float(flat[key]) / float(r[key]) if flat is not None and r.get(key) and flat.get(key) else None


def add_forecasts(results: list[dict[str, Any]], config: TreeBenchConfig) -> None:
    """The planner's forecast beside each ok flattened and tree_exact entry on CPU (`predicted_step_bytes`,
    `prediction_error` = predicted / measured − 1). Nothing when the planner cannot read the model."""
    if config.device != "cpu":
        return
    from longstraw import planner
    from longstraw.planner.tree import forecast

    try:
        spec = planner.spec_from_config(planner.load_config(config.model), config.model)
    except Exception as err:  # a forecast is a side note: it must not cost the measurements
        print(f"note: no planner forecast for {config.model} ({err})", file=sys.stderr)
        return
    base = planner.PlanInputs(prompt_tokens=2, response_tokens=1, group_size=1, dtype=config.dtype,
                              chunk_size=config.chunk_size, micro_batch=config.micro_batch, device="cpu",
                              optimizer="none")
    for r in results:
        if r.get("status") != "ok" or r["row"] not in ("flattened", "tree_exact"):
            continue
        predicted = forecast(spec, shape_of(config, r["tasks"], r["group_size"]), base)[r["row"]].step_bytes
        measured = float(r["peak_bytes"])
        r["predicted_step_bytes"] = predicted
        r["prediction_error"] = predicted / measured - 1 if measured >= PEAK_RESOLUTION else None


def checks(results: list[dict[str, Any]], config: TreeBenchConfig) -> dict[str, Any]:
    """The bench line of docs/trees.md, each with `ok` (None where the rows it needs did not run) and its numbers:

    * exact_lowest_peak: at every (K, G), tree_exact's peak below flattened's, per group's and packed's (tree_detach,
      which keeps no state gradient, is reported beside it: `detach_below_exact`, no verdict);
    * exact_flat_in_g: at the middle K, tree_exact's peak grows at most 5% from each G to the next;
    * exact_time_vs_floor: at every (K, G), tree_exact's time ratio over flattened >= 0.8 x its floor ratio;
    * packed_peak_grows: the packed row's peak increases with G (at the middle K) and with K (at the middle G)."""
    k0, g0 = middle(config.tasks), middle(config.groups)
    measured = sorted({(r["tasks"], r["group_size"]) for r in results if r.get("status") == "ok"})
    out: dict[str, Any] = {}

    # against the other ways of running the step (flattened, per group, packed); detach, LongStraw's other tree plan,
    # holds no state gradient and is compared on its own (`detach_below_exact`)
    lowest, detach = [], []
    for k, g in measured:
        exact = _find(results, "tree_exact", k, g)
        others = [r for r in results if r.get("status") == "ok" and (r["tasks"], r["group_size"]) == (k, g)
                  and r["row"] not in ("tree_exact", "tree_detach")]
        if exact is None:
            continue
        if others:
            above = all(float(o["peak_bytes"]) > float(exact["peak_bytes"]) for o in others)
            nearest = min(others, key=lambda o: float(o["peak_bytes"]))
            lowest.append({"tasks": k, "group_size": g, "ok": above, "tree_exact_mib": exact["peak_bytes"] / MIB,
                           "next_lowest": nearest["row"], "next_lowest_mib": nearest["peak_bytes"] / MIB})
        tree_detach = _find(results, "tree_detach", k, g)
        if tree_detach is not None:
            detach.append({"tasks": k, "group_size": g, "tree_detach_mib": tree_detach["peak_bytes"] / MIB,
                           "tree_exact_mib": exact["peak_bytes"] / MIB,
                           "below": float(tree_detach["peak_bytes"]) < float(exact["peak_bytes"])})
    out["exact_lowest_peak"] = {"ok": all(x["ok"] for x in lowest) if lowest else None, "at": lowest}
    out["detach_below_exact"] = {"ok": None, "at": detach}  # reported, not a requirement

    flat = []
    series = sorted((r["group_size"], float(r["peak_bytes"])) for r in results
                    if r.get("status") == "ok" and r["row"] == "tree_exact" and r["tasks"] == k0)
    for (g1, p1), (g2, p2) in zip(series, series[1:]):
        growth = p2 / p1 - 1 if p1 >= PEAK_RESOLUTION else None
        flat.append({"from_g": g1, "to_g": g2, "growth": growth,
                     "ok": None if growth is None else growth <= FLAT_TOLERANCE})
    out["exact_flat_in_g"] = {"ok": all(x["ok"] for x in flat) if flat and all(x["ok"] is not None for x in flat)
                              else None, "tasks": k0, "tolerance": FLAT_TOLERANCE, "steps": flat}

    timing = []
    for k, g in measured:
        exact = _find(results, "tree_exact", k, g)
        if exact is None or exact.get("time_ratio") is None:
            continue
        share = exact["time_ratio"] / exact["floor_ratio"]
        cpu = exact.get("cpu_time_ratio")
        floor = exact["floor_ratio"]
        timing.append({"tasks": k, "group_size": g, "time_ratio": exact["time_ratio"], "floor_ratio": floor,
                       "share_of_floor": share, "ok": share >= FLOOR_SHARE, "cpu_time_ratio": cpu,
                       "cpu_share_of_floor": None if cpu is None else cpu / floor})
    out["exact_time_vs_floor"] = {"ok": all(x["ok"] for x in timing) if timing else None, "share": FLOOR_SHARE,
                                  "at": timing}
    out["exact_time_vs_flop_floor"] = _flop_share(results, measured)

    grows = {}
    for axis, fixed, key in (("group_size", k0, "tasks"), ("tasks", g0, "group_size")):
        points = sorted((r[axis], float(r["peak_bytes"])) for r in results
                        if r.get("status") == "ok" and r["row"] == "packed" and r[key] == fixed)
        grows[axis] = {"peaks_mib": [[x, p / MIB] for x, p in points],
                       "ok": all(b > a for (_, a), (_, b) in zip(points, points[1:])) if len(points) > 1 else None}
    verdicts = [v["ok"] for v in grows.values() if v["ok"] is not None]
    out["packed_peak_grows"] = {"ok": all(verdicts) if verdicts else None, **grows}
    return out


def _flop_share(results: list[dict[str, Any]], measured: list[tuple[int, int]]) -> dict[str, Any]:
    """At every (K, G): tree_exact's time ratio over flattened, under glibc's default allocator (the timing run) and
    under the fixed mmap threshold (the peak run), against its FLOP floor ratio; ok where both reach it."""
    at = []
    for k, g in measured:
        exact = _find(results, "tree_exact", k, g)
        if exact is None or exact.get("flop_floor_ratio") is None or exact.get("time_ratio") is None:
            continue
        floor = exact["flop_floor_ratio"]
        shares = {name: None if exact.get(key) is None else exact[key] / floor
                  for name, key in (("default_allocator", "time_ratio"), ("cpu", "cpu_time_ratio"),
                                    ("fixed_threshold", "time_ratio_fixed_threshold"))}
        timed = [shares["default_allocator"], shares["fixed_threshold"]]
        at.append({"tasks": k, "group_size": g, "flop_floor_ratio": floor, **shares,
                   "ok": all(x is not None and x >= 1.0 for x in timed)})
    return {"ok": all(x["ok"] for x in at) if at else None, "share": 1.0, "at": at}


def document_checks(document: dict[str, Any]) -> dict[str, Any]:
    """`checks` of a results file, with the K and G it swept."""
    swept = replace(DEFAULT, tasks=tuple(document["config"]["tasks"]), groups=tuple(document["config"]["groups"]))
    return checks(document["results"], swept)


# ---------------------------------------------------------------- the table and the plot


ROW_LABELS = {"flattened": "flattened (TRL/verl)", "group": "LongStraw per group", "packed": "packed tree mask",
              "tree_exact": "LongStraw tree exact", "tree_detach": "LongStraw tree detach"}


def _num(value: Any, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:{fmt}}".rjust(width)


def format_table(document: dict[str, Any]) -> str:
    """One block per (K, G): a line per row with peak MiB, wall and CPU seconds, CPU pressure, token passes, floor
    ratio, time ratio, the planner's forecast and its error; then the checks and the floor formulas."""
    cfg = document["config"]
    results = document["results"]
    lines = [f"bench tree: {cfg['model']} {cfg['dtype']} {cfg['device']}, S={cfg['system_tokens']} "
             f"C={cfg['task_tokens']} T={cfg['turns']} r={cfg['response_tokens']} o={cfg['observation_tokens']} "
             f"{_fork_text(cfg)}, chunk {cfg['chunk_size']}, micro-batch {cfg['micro_batch']}, threads "
             f"{cfg['threads'] or 'default'}; host load {document.get('load_average')}"]
    head = (f"  {'row':<22}{'peak MiB':>9}{'time s':>9}{'cpu s':>8}{'press':>6}{'passes':>9}{'floor x':>8}"
            f"{'flop x':>8}{'time x':>8}{'cpu x':>7}{'plan MiB':>9}{'err':>8}")
    for k, g in dict.fromkeys((r["tasks"], r["group_size"]) for r in results):
        c = next(r["counts"] for r in results if (r["tasks"], r["group_size"]) == (k, g))
        lines.append(f"K={k} G={g}: {c['trajectories']} trajectories, {c['nodes']} nodes, depth {c['depth']}, "
                     f"{c['tokens_encoded']} tokens encoded of {c['tokens_flattened']} flattened")
        lines.append(head)
        for r in (x for x in results if (x["tasks"], x["group_size"]) == (k, g)):
            label = ROW_LABELS.get(r["row"], r["row"])
            if r.get("status") != "ok":
                lines.append(f"  {label:<22}FAILED: {r.get('error')}")
                continue
            err = r.get("prediction_error")
            plan = r.get("predicted_step_bytes")
            lines.append(
                f"  {label:<22}{peak_text(float(r['peak_bytes']), 9)}{r['time_s']:9.2f}{r['cpu_time_s']:8.2f}"
                f"{_num(r.get('cpu_pressure'), '.2f', 6)}{r['token_passes']:9d}{_num(r.get('floor_ratio'), '.2f', 8)}"
                f"{_num(r.get('flop_floor_ratio'), '.2f', 8)}"
                f"{_num(r.get('time_ratio'), '.2f', 8)}{_num(r.get('cpu_time_ratio'), '.2f', 7)}"
                f"{_num(None if plan is None else plan / MIB, '.1f', 9)}"
                f"{_num(None if err is None else 100 * err, '+.1f', 7)}{'%' if err is not None else ''}")
    lines.append("checks:")
    for name, check in document.get("checks", {}).items():
        verdict = {True: "PASS", False: "FAIL", None: "n/a" if name != "detach_below_exact" else "info"}[check["ok"]]
        lines.append(f"  {name:<22}{verdict}  {_check_detail(name, check)}")
    lines.append("token passes (floor): " + "; ".join(f"{row} = {f}" for row, f in FLOOR_FORMULAS.items()))
    lines.append(f"  ({FLOOR_NOTE})")
    lines.append(f"flop x: flattened's FLOP count / the row's ({FLOP_NOTE})")
    lines.append("floor x: flattened's passes / the row's; time x, cpu x: flattened's wall / CPU time over the row's "
                 "(same K, G); peak: the cold first step's; times: the fastest warm step's; plan MiB: `longstraw plan "
                 "--tree`'s forecast of the step peak")
    return "\n".join(lines)


def _fork_text(cfg: dict[str, Any]) -> str:
    """Where the shape branches (a results file without `fork` is a tau run: the last turns)."""
    fork = cfg.get("fork", "last")
    return {"last": f"B={cfg['branching']}", "first": "G-way fork at the first response"}[fork]


def _check_detail(name: str, check: dict[str, Any]) -> str:
    if name == "exact_lowest_peak":
        bad = [f"K={x['tasks']} G={x['group_size']}" for x in check["at"] if not x["ok"]]
        return ("below flattened, per group and packed at every K, G" if not bad
                else f"not below flattened, per group and packed at {', '.join(bad)}")
    if name == "detach_below_exact":
        return "tree detach / exact peak MiB: " + ", ".join(
            f"K={x['tasks']} G={x['group_size']}: {x['tree_detach_mib']:.0f}/{x['tree_exact_mib']:.0f}"
            for x in check["at"])
    if name == "exact_flat_in_g":
        steps = [f"G={s['from_g']}->{s['to_g']}: {_num(None if s['growth'] is None else 100 * s['growth'], '+.1f', 0)}%"
                 for s in check["steps"]]
        return f"K={check['tasks']}: " + ", ".join(steps)
    if name == "exact_time_vs_floor":
        return ", ".join(f"K={x['tasks']} G={x['group_size']}: {x['time_ratio']:.2f}x of floor "
                         f"{x['floor_ratio']:.2f}x ({x['share_of_floor']:.2f}; CPU time "
                         f"{_num(x['cpu_share_of_floor'], '.2f', 0)})" for x in check["at"])
    if name == "exact_time_vs_flop_floor":
        return ", ".join(f"K={x['tasks']} G={x['group_size']}: floor {x['flop_floor_ratio']:.2f}x, reached "
                         f"{_num(x['default_allocator'], '.2f', 0)} (fixed threshold "
                         f"{_num(x['fixed_threshold'], '.2f', 0)}, CPU time {_num(x['cpu'], '.2f', 0)})"
                         for x in check["at"])
    if name == "packed_peak_grows":
        return "; ".join(f"over {axis}: " + ", ".join(f"{x}: {p:.0f}" for x, p in check[axis]["peaks_mib"])
                         for axis in ("group_size", "tasks"))
    return ""


def plot_tree(document: dict[str, Any], path: str) -> str | None:
    """Peak and step time vs G at the middle K, one line per row (`plots._two_panels`)."""
    from benchmarks.plots import _two_panels

    cfg = document["config"]
    k0 = middle(tuple(cfg["tasks"]))
    at_k0 = {**document, "results": [r for r in document["results"] if r["tasks"] == k0]}
    title = (f"bench tree: {cfg['model']} S={cfg['system_tokens']} K={k0} C={cfg['task_tokens']} T={cfg['turns']} "
             f"r={cfg['response_tokens']} o={cfg['observation_tokens']}"
             + ("" if cfg.get("fork", "last") == "last" else f", {_fork_text(cfg)}"))
    return _two_panels(at_k0, path, "group_size", "trajectories per task G", title)


# ---------------------------------------------------------------- the run


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_tree_bench(config: TreeBenchConfig, out: str) -> dict[str, Any]:
    """Every (K, G) and row in a fresh worker; progress on stderr, a partial file after each row; then ratios,
    forecasts, checks, the JSON, the plot and the table."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    document = sweep_document("tree", config, config.device)
    document["load_average"] = _load()
    document["token_pass_formulas"] = FLOOR_FORMULAS
    document["token_pass_note"] = FLOOR_NOTE
    jobs = [(k, g, row) for k, g in pairs(config) for row in config.rows]
    print(f"bench tree: {config.model}, {len(jobs)} rows, one process each", file=sys.stderr)
    for k, g, row in jobs:
        entry = run_row(config, row, k, g)
        document["results"].append(entry)
        print_progress(len(document["results"]), entry, f"K={k} G={g}")
        write_json(out + ".tmp", document)
    add_ratios(document["results"])
    add_forecasts(document["results"], config)
    document["checks"] = checks(document["results"], config)
    document["load_average_end"] = _load()
    contended = [r for r in document["results"] if r.get("status") == "ok" and busy(r)]
    if contended:
        document.setdefault("notes", []).append(
            f"host load average {document['load_average']} at the start, {document['load_average_end']} at the end")
    finish_sweep(document, out, format_table(document), plot_tree, smoke=config.smoke)
    return document


# ---------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=tuple(SHAPES), default="tau",
                        help="the batch and rows: tau (default), tau^2-bench trajectories branching at the last turns, "
                             "every row; trl-async, TRL's async GRPO batches, G conversations per prompt forking at "
                             "the first response, packed / tree_exact / flattened as G doubles 2 to 16 (the module "
                             "docstring); the options below override the shape's values (their defaults: tau's)")
    parser.add_argument("--smoke", action="store_true",
                        help="the shape's tiny-llama run at a tiny size (tau: one K and G; trl-async: G 2 and 4); "
                             "seconds, only that every row runs (the tests)")
    parser.add_argument("--model", help=f"a preset ({', '.join(PRESET_NAMES)}), a local directory or a Hugging Face "
                                        f"id (default {DEFAULT.model})")
    parser.add_argument("--dtype", choices=DTYPES, help=f"parameter dtype (default {DEFAULT.dtype})")
    parser.add_argument("--device", help="cpu or cuda[:i] (default cpu)")
    parser.add_argument("--system-tokens", type=positive_int, metavar="S",
                        help=f"the system prompt + tools every trajectory shares (default {DEFAULT.system_tokens})")
    parser.add_argument("--task-tokens", type=positive_int, metavar="C",
                        help=f"each task's tokens (default {DEFAULT.task_tokens})")
    parser.add_argument("--turns", type=positive_int, metavar="T", help=f"turns per trajectory (default "
                                                                       f"{DEFAULT.turns})")
    parser.add_argument("--response-tokens", type=positive_int, metavar="r",
                        help=f"each turn's response tokens, in the loss (default {DEFAULT.response_tokens})")
    parser.add_argument("--observation-tokens", type=int, metavar="o",
                        help=f"each turn's observation tokens, masked out of the loss (default "
                             f"{DEFAULT.observation_tokens})")
    parser.add_argument("--branching", type=positive_int, metavar="B",
                        help=f"ways each branching turn forks (default {DEFAULT.branching}); G must be a power of B")
    parser.add_argument("--fork", choices=FORKS,
                        help="where a task's trajectories branch: last (tau's), B ways at each of the last log_B(G) "
                             "turns; first (trl-async's), G ways at the first response")
    parser.add_argument("--tasks", type=positive_int, nargs="+", metavar="K",
                        help=f"tasks per batch, swept (default {' '.join(map(str, DEFAULT.tasks))})")
    parser.add_argument("--groups", type=positive_int, nargs="+", metavar="G",
                        help=f"trajectories per task, swept (default {' '.join(map(str, DEFAULT.groups))})")
    parser.add_argument("--grid", choices=("cross", "full"),
                        help="cross (default): every K at the middle G and every G at the middle K; full: every pair")
    parser.add_argument("--rows", nargs="+", choices=ROWS, metavar="ROW",
                        help=f"rows to run, of {', '.join(ROWS)} (default all)")
    parser.add_argument("--chunk-size", type=positive_int, help=f"LongStraw's chunk (default {DEFAULT.chunk_size})")
    parser.add_argument("--micro-batch", type=positive_int,
                        help=f"LongStraw: sibling leaves / responses replayed at once (default {DEFAULT.micro_batch})")
    parser.add_argument("--threads", type=positive_int,
                        help="torch threads per worker (OMP_NUM_THREADS; default torch's own)")
    parser.add_argument("--warm-steps", type=non_negative_int, metavar="N",
                        help=f"steps after the first in each worker; the peak is the first (cold) step's, the time "
                             f"the fastest later step's (default {DEFAULT.warm_steps}; 0: the cold step's time)")
    parser.add_argument("--seed", type=int, help="seed of the synthetic batch (default 0)")
    parser.add_argument("--timeout", type=positive_float, metavar="SECONDS",
                        help="per-row limit; a row over it is recorded as failed")
    parser.add_argument("--out", help="result JSON (default bench/results/tree-<name>-<YYYYmmdd-HHMMSS>.json)")


def config_from_args(args: argparse.Namespace) -> TreeBenchConfig:
    config = SHAPES[args.shape][1 if args.smoke else 0]
    overrides = {
        "model": args.model, "dtype": args.dtype, "device": args.device, "system_tokens": args.system_tokens,
        "task_tokens": args.task_tokens, "turns": args.turns, "response_tokens": args.response_tokens,
        "observation_tokens": args.observation_tokens, "branching": args.branching, "fork": args.fork,
        "tasks": tuple(dict.fromkeys(args.tasks)) if args.tasks else None,
        "groups": tuple(dict.fromkeys(args.groups)) if args.groups else None, "grid": args.grid,
        "rows": tuple(dict.fromkeys(args.rows)) if args.rows else None, "chunk_size": args.chunk_size,
        "micro_batch": args.micro_batch, "threads": args.threads, "warm_steps": args.warm_steps, "seed": args.seed,
        "timeout_s": args.timeout,
    }
    config = replace(config, **{k: v for k, v in overrides.items() if v is not None})
    if config.observation_tokens < 0:
        args.fail(f"--observation-tokens must be >= 0, got {config.observation_tokens}")
    try:  # every swept shape is valid (G a power of B, enough turns to branch) before any worker starts
        for k, g in pairs(config):
            shape_of(config, k, g)
    except ValueError as err:
        args.fail(str(err))
    check_device(config.device, args.fail)
    check_model(config.model, args.fail)
    return config


def default_tree_out(config: TreeBenchConfig) -> str:
    folder = os.path.join("bench", "results", "smoke") if config.smoke else os.path.join("bench", "results")
    return os.path.join(folder, f"tree-{config.name}-{time.strftime('%Y%m%d-%H%M%S')}.json")


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of `python -m benchmarks tree`: exit status 0 if at least one row ran."""
    check_out(args.out, args.fail)
    config = config_from_args(args)
    document = run_tree_bench(config, args.out or default_tree_out(config))
    if not any(r.get("status") == "ok" for r in document["results"]):
        print("bench tree: every row failed; see stderr_tail in the .tmp results file", file=sys.stderr)
        return 1
    return 0


BENCHMARKS = (Benchmark(
    name="tree", help="agent batches of prefix trees (tau^2-bench, or TRL's async GRPO with --shape trl-async): "
                      "flattened, per group, packed tree mask, LongStraw tree exact and detach",
    description="A shared system prompt, K tasks, G branching multi-turn trajectories per task, run up to five ways, "
                "each row in a fresh process: peak memory, step time, the token-pass floor beside the measured ratio, "
                "the planner's forecast; K and G swept; table, JSON and plot. --shape trl-async: G conversations "
                "per prompt forking at the first response, packed against LongStraw's tree as G doubles.",
    add_arguments=add_arguments, run=run_from_args, table=format_table, checks=document_checks),)
