"""`python -m benchmarks pareto`: fixed (P, R, G), time vs peak over micro_batch ∈ {1, 2, 4, 8} × several chunk sizes ×
the memory levers (per-layer activation checkpointing, the prompt state offloaded to host memory) for detach and
exact; each point is marked when it is on its plan's Pareto front (no other point of the plan, with or without a
lever, is at least as good in both and better in one) and on the front of all points together. The lever cost:
per plan and lever, the median of time(lever)/time(plain) and peak(lever)/peak(plain) at equal
(micro_batch, chunk_size).

Every configuration runs in a fresh worker (`benchmarks/worker.py`) exactly as `bench memory` does; `--smoke` runs a
tiny grid in one worker process. Its command line is with the other sweeps' (`benchmarks/sweeps.py`).
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass, replace
from typing import Any

from benchmarks.common import (
    MIB,
    finish_sweep,
    job_config,
    print_progress,
    run_batch,
    sweep_document,
    write_json,
)

# Plans that keep a prompt state, the only ones `backward_group(offload_state=True)` accepts.
OFFLOAD_PLANS = ("detach", "exact")
# `bench pareto --offload` words -> ParetoBenchConfig.offloads
OFFLOAD_CHOICES = {"no": False, "yes": True}


@dataclass(frozen=True)
class ParetoBenchConfig:
    """Micro-batch x chunk-size x checkpoint x offload grid for detach and exact at B1's P, R and G = 8.

    offloads: True runs only for the plans with a prompt state (detach, exact); keeps > 0 only for exact; `extra`
    adds single (plan, micro_batch, chunk_size, checkpoint, offload_state[, keep_prompt_graph]) configurations
    after the grid (the smoke's offloaded and kept-graph configurations)."""

    model: str = "b1-llama"
    dtype: str = "float32"
    device: str = "cpu"
    prompt_tokens: int = 4096
    response_tokens: int = 256
    group_size: int = 8
    plans: tuple[str, ...] = ("detach", "exact")
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    chunk_sizes: tuple[int, ...] = (1024, 2048, 4096)
    checkpoints: tuple[str, ...] = ("none", "layers")
    offloads: tuple[bool, ...] = (False, True)
    keeps: tuple[int, ...] = (0,)  # exact: capture chunks whose graph is kept (backward_group(keep_prompt_graph))
    extra: tuple[tuple, ...] = ()  # (plan, k, chunk, checkpoint, offload[, keep])
    seed: int = 0
    timeout_s: float | None = None
    malloc_mmap_threshold: int = 128 * 1024
    isolate: bool = True
    smoke: bool = False  # --smoke: report only that every configuration ran


# Smoke: both checkpoint settings on a small grid, the offloaded state on one exact configuration (with and
# without checkpointing), so every lever runs and has a cost: 10 configurations, about as cheap as the 8 before.
PARETO_SMOKE = ParetoBenchConfig(model="tiny-llama", prompt_tokens=64, response_tokens=8, group_size=4,
                                 micro_batches=(1, 4), chunk_sizes=(32,), offloads=(False,),
                                 extra=(("exact", 1, 32, "none", True), ("exact", 1, 32, "layers", True),
                                        ("exact", 1, 32, "none", False, 2)),
                                 isolate=False, smoke=True)


def pareto_flags(points: list[tuple[float, float]]) -> list[bool]:
    """For (memory, time) points: True where no other point is <= in both and < in one (minimisation)."""
    flags = []
    for i, (m, t) in enumerate(points):
        dominated = any(m2 <= m and t2 <= t and (m2 < m or t2 < t) for j, (m2, t2) in enumerate(points) if j != i)
        flags.append(not dominated)
    return flags


def lever_name(checkpoint: str, offload_state: bool, keep: int = 0) -> str:
    """`plain`, or the levers a configuration pulls joined by "+": `checkpoint`, `offload`, `keep` (the exact
    plan's kept capture graphs: a lever that spends memory to save time)."""
    levers = ((["checkpoint"] if checkpoint != "none" else []) + (["offload"] if offload_state else [])
              + (["keep"] if keep else []))
    return "+".join(levers) or "plain"


def lever_suffix(checkpoint: str, offload_state: bool, keep: int = 0) -> str:
    """The short label of the levers for tables and plots: "", "+ck", "+off", "+keepN" and their combinations."""
    return ("+ck" if checkpoint != "none" else "") + ("+off" if offload_state else "") + (f"+keep{keep}" if keep
                                                                                          else "")


def pareto_grid(cfg: ParetoBenchConfig) -> list[tuple[str, int, int, str, bool, int]]:
    """(plan, micro_batch, chunk_size, checkpoint, offload_state, keep_prompt_graph) for every configuration of the
    sweep: the grid (offloading only for the plans with a prompt state, kept graphs only for exact) and then
    `cfg.extra`, without repeats."""
    grid = [(plan, k, c, ck, off, keep) for plan in cfg.plans for off in cfg.offloads
            if not off or plan in OFFLOAD_PLANS for keep in (cfg.keeps if plan == "exact" else (0,))
            for ck in cfg.checkpoints for k in cfg.micro_batches for c in cfg.chunk_sizes]
    extra = [(*x[:5], x[5] if len(x) > 5 else 0) for x in cfg.extra]
    return list(dict.fromkeys(grid + extra))


def _median_ratio(pairs: list[tuple[float, float]]) -> float | None:
    ratios = [a / b for a, b in pairs if b > 0 and math.isfinite(a / b)]
    return statistics.median(ratios) if ratios else None


def lever_costs(results: list[dict]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per plan and lever: the median of time(lever)/time(plain) and peak(lever)/peak(plain) over the
    (micro_batch, chunk_size) where both ran ok (`pairs` of them); a ratio is None when no plain value was > 0."""
    ok = [r for r in results if r.get("status") == "ok"]

    def key(r: dict) -> tuple:
        return r["plan"], r["micro_batch"], r["chunk_size"]

    def levers(r: dict) -> str:
        return lever_name(r["checkpoint"], r["offload_state"], r.get("keep_prompt_graph", 0))

    plain = {key(r): r for r in ok if levers(r) == "plain"}
    pairs: dict[str, dict[str, list[tuple[dict, dict]]]] = {}
    for r in ok:
        lever = levers(r)
        if lever != "plain" and key(r) in plain:
            pairs.setdefault(r["plan"], {}).setdefault(lever, []).append((r, plain[key(r)]))
    return {plan: {lever: {
        "pairs": len(both),
        "time_ratio": _median_ratio([(r["time_s"], p["time_s"]) for r, p in both]),
        "peak_ratio": _median_ratio([(r["peak_bytes"], p["peak_bytes"]) for r, p in both]),
    } for lever, both in levers.items()} for plan, levers in pairs.items()}


def _lever_lines(costs: dict) -> list[str]:
    if not costs:
        return []

    def x(v: float | None) -> str:
        return f"x{v:.2f}" if v is not None else "-"

    lines = ["lever cost (median over equal micro_batch and chunk; lever / plain):"]
    for plan, levers in costs.items():
        for lever, c in levers.items():
            lines.append(f"  {plan:<8} {lever:<19} time {x(c['time_ratio']):>7}  peak {x(c['peak_ratio']):>7}  "
                         f"({c['pairs']} pairs)")
    return lines


def run_pareto_bench(cfg: ParetoBenchConfig, out: str) -> dict[str, Any]:
    """Every (plan, micro_batch, chunk_size, checkpoint, offload); Pareto flags per plan over all its levers
    (`pareto`) and over all (`pareto_all`); the levers' cost as `lever_costs`."""
    document = sweep_document("pareto", cfg, cfg.device)
    results: list[dict] = document["results"]
    grid = pareto_grid(cfg)
    print(f"bench pareto: {cfg.model} P={cfg.prompt_tokens} R={cfg.response_tokens} G={cfg.group_size}, "
          f"{len(grid)} configurations", file=sys.stderr)
    batches = [[x] for x in grid] if cfg.isolate else [grid]
    for batch in batches:
        jobs = [(replace(job_config(cfg, cfg.model, cfg.prompt_tokens, c, k), offload_state=off,
                         keep_prompt_graph=keep), plan, cfg.group_size, ck) for plan, k, c, ck, off, keep in batch]
        for (_, k, c, ck, off, keep), entry in zip(batch, run_batch(jobs, isolate=cfg.isolate)):
            entry.update(micro_batch=k, chunk_size=c, checkpoint=ck, offload_state=off, keep_prompt_graph=keep,
                         prompt_tokens=cfg.prompt_tokens)
            results.append(entry)
            print_progress(len(results), entry, f"k={k} chunk={c}{lever_suffix(ck, off, keep)}")
        write_json(out + ".tmp", document)
    ok = [r for r in results if r["status"] == "ok"]
    for r, flag in zip(ok, pareto_flags([(r["peak_bytes"], r["time_s"]) for r in ok])):
        r["pareto_all"] = flag
    for plan in cfg.plans:
        mine = [r for r in ok if r["plan"] == plan]
        for r, flag in zip(mine, pareto_flags([(r["peak_bytes"], r["time_s"]) for r in mine])):
            r["pareto"] = flag
    document["lever_costs"] = costs = lever_costs(results)
    if cfg.device == "cpu" and any(r["offload_state"] for r in results):
        document.setdefault("notes", []).append(
            "on CPU the offloaded prompt state stays in the same (host) memory: the offload lever's peak shows "
            "its copies, not the device memory it saves on a GPU")
    lines = [f"{'plan':<8} {'k':>3} {'chunk':>6} {'ckpt':>6} {'offload':>7} {'keep':>4} {'peak MiB':>10} "
             f"{'time s':>8}  front"]
    for r in results:
        head = (f"{r['plan']:<8} {r['micro_batch']:>3} {r['chunk_size']:>6} {r['checkpoint']:>6} "
                f"{'yes' if r['offload_state'] else 'no':>7} {r['keep_prompt_graph']:>4}")
        if r["status"] != "ok":
            lines.append(f"{head}  FAILED: {r['error']}")
            continue
        mark = ("plan" if r.get("pareto") else "") + (" + all" if r.get("pareto_all") else "")
        lines.append(f"{head} {r['peak_bytes'] / MIB:>10.1f} {r['time_s']:>8.2f}  {mark}")
    lines += _lever_lines(costs)
    from benchmarks.plots import plot_pareto

    finish_sweep(document, out, "\n".join(lines), plot_pareto, cfg.smoke)
    return document

