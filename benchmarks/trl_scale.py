"""`python -m benchmarks trl-scale`: TRL's GRPOTrainer and the drop-in on 2 processes, with DDP, FSDP2 and context
parallelism: per-rank peak memory, prompt state and step time, beside the planner's forecast.

Rows (each as 2 CPU processes over gloo, torchrun's environment, a fresh pair per row; `--smoke` runs every row in
one pair): `trl.GRPOTrainer` with DDP and with FSDP2, `LongStrawGRPOTrainer` (exact plan) with DDP, with FSDP2, and
with FSDP2 and `longstraw_cp=2` (the two ranks exchange their groups and each holds half of every prompt's K/V), and
the same with `longstraw_fsdp_gather="layer"` (a decoder layer gathered at a time).
One optimizer step of one group per rank, generation a fixed function, SGD without momentum (no optimizer state),
TRL's default activation checkpointing: `benchmarks/trl_scale_worker.py` says exactly what runs and what is measured.

Default shape: b1-llama, float32, P = 8192 prompt tokens, G = 8 completions of R = 128 tokens, capture chunk 1024.

Per row the table gives the largest rank's: step peak (VmHWM above the RSS at the start of the step, after the model
was prepared: the whole step, optimizer included), the local bytes of parameters + optimizer state at rest, the
step peak plus those (what the rank holds at its peak, tensors only), the process's absolute VmHWM, the prompt state
a rank holds, the step's wall and CPU time and CPU pressure; then `longstraw plan`'s forecast of the step peak
(`step_bytes`: the peak above the weights, `--optimizer none`) for the same configuration and measured / forecast.
The forecasts: TRL rows are `standard_batched` (G full sequences in one batch), the drop-in's `exact`, both with
`--checkpoint-layers` when checkpointing is on, `--gpus 2`, `--no-shard` for DDP, `--cp 2` for the context-parallel
row. TRL's FSDP2 gathers a layer at a time (FSDP's own schedule, which the planner's standard plans model); the
drop-in runs under `sharded_compute`, which gathers every parameter once, holds the full gradient, and reduce-scatters
it unit by unit at the block's end (the planner's default `--fsdp-gather all`, with its `gradient_reduce` phase), or
with gather="layer" a decoder layer at a time (`--fsdp-gather layer`): its FSDP rows carry that note.

Times: the 2 ranks share this machine's cores (one torch thread each on 2 cores) and other processes may compete
for them (`cpu_pressure`); compare times as ratios within a run. Peaks do not depend on the load.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.common import (
    B1,
    MIB,
    SMOKE_NOTE,
    STDERR_TAIL,
    busy,
    check_model,
    check_out,
    default_out,
    mib_text,
    positive_float,
    write_json,
    write_results,
)
from benchmarks.launch import describe_exit, free_port, rank_env, run_ranks, worker_command, worker_env
from benchmarks.machine import machine_info
from benchmarks.registry import Benchmark
from longstraw.choices import PRESET_NAMES
from longstraw.planner import positive_int

WORLD = 2  # processes per row
DEFAULT_TIMEOUT_S = 3600.0  # per row
PLANNER_AGREEMENT = 0.10  # measured / forecast within 1 ± this counts as agreement
# The extra's packages the worker imports (pyproject's `trl` extra).
NEEDED = ("trl", "accelerate", "datasets")


@dataclass(frozen=True)
class Shape:
    """The one shape every row runs."""

    model: str
    prompt_tokens: int
    response_tokens: int
    group_size: int
    chunk_size: int  # the drop-in's capture chunk (longstraw_chunk_size)
    dtype: str = "float32"
    gradient_checkpointing: bool = True  # TRL's default; the drop-in follows it (per-layer checkpointing)


SHAPES = {
    "default": Shape("b1-llama", 8192, 128, 8, chunk_size=1024),
    # 255 encoded prompt positions in 4 capture chunks, so that the context-parallel split is 128 + 127 positions.
    "smoke": Shape("tiny-llama", 256, 8, 4, chunk_size=64),
}


@dataclass(frozen=True)
class Row:
    """One row: the trainer ("trl": trl.GRPOTrainer, "longstraw": the drop-in), FSDP2 or DDP, context-parallel size."""

    id: str
    label: str
    trainer: str
    fsdp: bool
    cp: int = 1
    gather: str = "all"  # the drop-in's longstraw_fsdp_gather (FSDP rows)

    @property
    def plan(self) -> str:
        """The planner's plan for this row: TRL runs G full sequences in one batch, the drop-in the exact plan."""
        return "exact" if self.trainer == "longstraw" else "standard_batched"


ROWS = (
    Row("trl-ddp", "TRL DDP", "trl", fsdp=False),
    Row("trl-fsdp2", "TRL FSDP2", "trl", fsdp=True),
    Row("longstraw-ddp", "LongStraw DDP", "longstraw", fsdp=False),
    Row("longstraw-fsdp2", "LongStraw FSDP2", "longstraw", fsdp=True),
    Row("longstraw-fsdp2-cp2", "LongStraw FSDP2 + cp 2", "longstraw", fsdp=True, cp=2),
    Row("longstraw-fsdp2-cp2-layer", "LongStraw FSDP2 + cp 2, layer", "longstraw", fsdp=True, cp=2, gather="layer"),
)


# ---------------------------------------------------------------- the planner's forecast


def planner_command(shape: Shape, row: Row) -> str:
    """The `longstraw plan` command whose `row.plan` column is this row's forecast."""
    parts = [f"longstraw plan --model {shape.model} --prompt-tokens {shape.prompt_tokens} "
             f"--response-tokens {shape.response_tokens} --group-size {shape.group_size} --dtype {shape.dtype} "
             f"--gpus {WORLD} --device cpu --optimizer none --chunk-size {shape.chunk_size}"]
    if not row.fsdp:
        parts.append("--no-shard")
    if row.cp > 1:
        parts.append(f"--cp {row.cp}")
    if row.gather != "all":
        parts.append(f"--fsdp-gather {row.gather}")
    if shape.gradient_checkpointing:
        parts.append("--checkpoint-layers")
    return " ".join(parts) + f"  (column {row.plan})"


FSDP_NOTE = ("planner: sharded_compute gathers every parameter once, holds the full gradient, and reduce-scatters it "
             "unit by unit at the block's end (--fsdp-gather all; phase gradient_reduce)")
FSDP_LAYER_NOTE = ("planner: sharded_compute(gather='layer') gathers the decoder layers one at a time through FSDP's "
                   "hooks and holds the embeddings and output projection with their gradient (--fsdp-gather layer)")


def forecast(shape: Shape, row: Row) -> dict[str, Any]:
    """The planner's forecast for the row (`planner_command`), or why there is none."""
    from longstraw import planner

    try:
        spec = planner.spec_from_config(planner.load_config(shape.model), shape.model)
        inputs = planner.PlanInputs(
            prompt_tokens=shape.prompt_tokens, response_tokens=shape.response_tokens, group_size=shape.group_size,
            dtype=shape.dtype, gpus=WORLD, cp=row.cp, shard=row.fsdp, chunk_size=shape.chunk_size,
            optimizer="none", device="cpu", checkpoint_layers=shape.gradient_checkpointing, fsdp_gather=row.gather)
        est = planner.estimate(spec, inputs, row.plan)
    except Exception as err:  # a bench must not die on a model the planner does not know
        return {"plan": row.plan, "command": planner_command(shape, row), "step_bytes": None,
                "error": f"the planner cannot express this row: {err}"}
    out: dict[str, Any] = {"plan": row.plan, "command": planner_command(shape, row), "step_bytes": est.step_bytes,
                           "total_bytes": est.total_bytes, "prompt_state_bytes": est.prompt_state_bytes,
                           "peak_phase": est.peak_phase, "components": est.components}
    if row.fsdp and row.trainer == "longstraw":
        out["note"] = FSDP_NOTE if row.gather == "all" else FSDP_LAYER_NOTE
    return out


# ---------------------------------------------------------------- running the ranks


def run_pair(shape: Shape, rows: list[Row], timeout_s: float | None, smoke: bool) -> list[dict[str, Any]]:
    """Run `rows` in one pair of fresh worker processes (torchrun's environment, ACCELERATE_USE_CPU=1: accelerate's
    MULTI_CPU over gloo); one entry per row: status "ok" with each rank's measurement, or "failed" with the error and
    the ranks' output tails. Never raises."""
    job = {"shape": asdict(shape), "rows": [asdict(row) for row in rows]}
    port = free_port()
    base = worker_env(B1.malloc_mmap_threshold, smoke)
    for name in ("TORCHELASTIC_RUN_ID", "ACCELERATE_USE_FSDP"):  # not a torchrun child; no FSDP left over
        base.pop(name, None)
    # One torch thread per rank on 2 cores; a smoke run keeps worker_env's (1 unless the caller set it).
    threads = base["OMP_NUM_THREADS"] if smoke else str(max(1, (os.cpu_count() or 1) // WORLD))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trl-scale")
        envs = [rank_env(base, rank, WORLD, port, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS=threads)
                for rank in range(WORLD)]
        codes, outputs, timed_out = run_ranks(worker_command("trl_scale_worker", json.dumps(job), out), envs,
                                              timeout_s, cwd=tmp)
        error = f"timed out after {timeout_s:.0f} s" if timed_out else None
        if error is None and any(codes):
            error = "; ".join(f"rank {r}: {describe_exit(c)}" for r, c in enumerate(codes) if c)
        ranks: list[list[dict[str, Any]]] = []
        for rank in range(WORLD):
            path = Path(f"{out}.rank{rank}")
            ranks.append(json.loads(path.read_text()) if path.exists() else [])
    process_s = time.perf_counter() - t0
    entries = []
    for index in range(len(rows)):
        measured = [rank[index] for rank in ranks if len(rank) > index]
        if len(measured) == WORLD:
            entries.append({"status": "ok", "ranks": measured, "process_s": process_s})
        else:
            tails = [text[-STDERR_TAIL // WORLD:] for text in outputs]
            entries.append({"status": "failed", "error": error or "a rank wrote no result", "output_tails": tails,
                            "process_s": process_s})
    return entries


# ---------------------------------------------------------------- one row's entry


def _largest(ranks: list[dict[str, Any]], key: str) -> Any:
    values = [r[key] for r in ranks if r.get(key) is not None]
    return max(values) if values else None


def summarize_row(shape: Shape, row: Row, run: dict[str, Any]) -> dict[str, Any]:
    """The row's entry: its identity, the run's status, the largest rank's numbers, the forecast and the ratio."""
    entry: dict[str, Any] = {"id": row.id, "label": row.label, "trainer": row.trainer, "fsdp": row.fsdp,
                             "cp": row.cp, "gather": row.gather, **run, "forecast": forecast(shape, row)}
    if run["status"] != "ok":
        return entry
    ranks = run["ranks"]
    entry.update({key: _largest(ranks, key) for key in (
        "step_peak_bytes", "loss_backward_peak_bytes", "absolute_hwm_bytes", "param_bytes", "grad_bytes",
        "optimizer_state_bytes", "at_rest_bytes", "prompt_state_bytes", "time_s", "cpu_time_s", "cpu_pressure")})
    entry["peak_with_at_rest_bytes"] = max(r["step_peak_bytes"] + r["at_rest_bytes"] for r in ranks)
    entry["sharded"] = all(r["sharded"] for r in ranks)
    entry["distributed_type"] = sorted({r["distributed_type"] for r in ranks})
    predicted = entry["forecast"].get("step_bytes")
    entry["measured_over_forecast"] = entry["step_peak_bytes"] / predicted if predicted else None
    return entry


def checks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """What the run shows: the context-parallel row against every TRL row (step peak, and with the tensors at rest),
    its prompt state against the FSDP2 row's without context parallelism, every FSDP row sharded, and which rows
    the planner forecast within ±10%. A part whose rows did not run is left out."""
    by_id = {r["id"]: r for r in results if r.get("status") == "ok"}
    out: dict[str, Any] = {"fsdp_rows_sharded": {r["id"]: r["sharded"] for r in by_id.values() if r["fsdp"]}}
    cp2, trl = by_id.get("longstraw-fsdp2-cp2"), [r for r in by_id.values() if r["trainer"] == "trl"]
    if cp2 and trl:
        for key in ("step_peak_bytes", "peak_with_at_rest_bytes", "absolute_hwm_bytes"):
            out[f"cp2_below_every_trl_row_{key.removesuffix('_bytes')}"] = all(cp2[key] < r[key] for r in trl)
    cp1 = by_id.get("longstraw-fsdp2")
    if cp2 and cp1 and cp1.get("prompt_state_bytes"):
        out["cp2_prompt_state_over_cp1"] = cp2["prompt_state_bytes"] / cp1["prompt_state_bytes"]
    out["planner_within_10_percent"] = {
        r["id"]: abs(r["measured_over_forecast"] - 1) <= PLANNER_AGREEMENT
        for r in by_id.values() if r.get("measured_over_forecast") is not None}
    return out


# ---------------------------------------------------------------- the table


TABLE_NOTE = (
    "step peak: the largest rank's VmHWM above its RSS at the start of the step (after accelerate prepared the model: "
    "an FSDP rank holds only its shards there), through the optimizer step (SGD: no state); at rest: the rank's "
    "local parameters + optimizer state between steps; peak+rest: the two together (tensors only); VmHWM: the "
    "process's absolute high-water mark (interpreter and libraries included); state: the prompt state a rank holds "
    "for one group; forecast: `longstraw plan`'s step_bytes for the row (standard_batched for TRL, exact for "
    "LongStraw), ratio = step peak / forecast; step s / CPU s: the larger rank's wall time / process CPU time (CPU "
    "time is less sensitive to other load); CPU pr.: the share of the step during which a runnable task waited for a "
    "core; times are comparable only within a run")


def format_table(document: dict[str, Any]) -> str:
    shape = document["shape"]
    results: list[dict[str, Any]] = document["results"]
    width = max(len(str(r["label"])) for r in results)
    lines = [f"{shape['model']} {shape['dtype']}, P={shape['prompt_tokens']} R={shape['response_tokens']} "
             f"G={shape['group_size']}, {WORLD} processes (gloo), one group per rank, chunk {shape['chunk_size']}, "
             f"checkpointing {'on' if shape['gradient_checkpointing'] else 'off'}, SGD; per rank, MiB",
             f"{'row':<{width}}  {'sharded':>7} {'step peak':>9} {'at rest':>9} {'peak+rest':>9} {'VmHWM':>9} "
             f"{'state':>7} {'step s':>8} {'CPU s':>7} {'CPU pr.':>7} {'forecast':>9} {'ratio':>6}"]
    notes = []
    for r in results:
        fc = r["forecast"]
        if r["status"] != "ok":
            lines.append(f"{str(r['label']):<{width}}  FAILED: {r.get('error')}")
            continue
        ratio = r.get("measured_over_forecast")
        sharded = ("yes" if r["sharded"] else "NO") if r["fsdp"] else "no"
        pressure = r.get("cpu_pressure")
        state = r.get("prompt_state_bytes")
        mark = ""
        if fc.get("step_bytes") is None:
            notes.append(f"{r['label']}: {fc.get('error')}")
        elif fc.get("note"):
            notes.append(f"{r['label']}: {fc['note']}")
            mark = "*"
        state_text = "-" if state is None else f"{state / MIB:.2f}"
        pressure_text = "-" if pressure is None else f"{pressure:.0%}"
        cpu_s = max(float(rank["cpu_time_s"]) for rank in r["ranks"])
        predicted = fc.get("step_bytes")
        forecast_text = "n/a" if predicted is None else f"{predicted / MIB:.1f}"
        ratio_text = "-" if ratio is None else f"{ratio:.2f}{mark}"
        lines.append(
            f"{str(r['label']):<{width}}  {sharded:>7} {mib_text(r['step_peak_bytes'])} {mib_text(r['at_rest_bytes'])} "
            f"{mib_text(r['peak_with_at_rest_bytes'])} {mib_text(r['absolute_hwm_bytes'])} {state_text:>7} "
            f"{r['time_s']:8.2f} {cpu_s:7.1f} {pressure_text:>7} {forecast_text:>9} {ratio_text:>6}"
            f"{'  (host busy)' if busy(r) else ''}")
    summary = document.get("checks", {})
    if "cp2_prompt_state_over_cp1" in summary:
        lines.append(f"prompt state, cp 2 / cp 1 (FSDP2): {summary['cp2_prompt_state_over_cp1']:.3f}")
    if "cp2_below_every_trl_row_step_peak" in summary:
        lines.append("LongStraw FSDP2 + cp 2 below every TRL row: step peak "
                     f"{'yes' if summary['cp2_below_every_trl_row_step_peak'] else 'NO'}, peak+rest "
                     f"{'yes' if summary['cp2_below_every_trl_row_peak_with_at_rest'] else 'NO'}, VmHWM "
                     f"{'yes' if summary['cp2_below_every_trl_row_absolute_hwm'] else 'NO'}")
    within = summary.get("planner_within_10_percent", {})
    if within:
        lines.append("planner within ±10%: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in within.items()))
    lines += [f"* {note}" for note in dict.fromkeys(notes)]
    lines.append(textwrap.fill(TABLE_NOTE, width=118))
    return "\n".join(lines)


# ---------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = SHAPES["default"]
    parser.add_argument("--model", default=default.model, help=f"a preset ({', '.join(PRESET_NAMES)}), a local "
                                                                 f"directory or a Hugging Face id (default "
                                                                 f"{default.model})")
    parser.add_argument("--prompt-tokens", type=positive_int, default=default.prompt_tokens,
                        help=f"P (default {default.prompt_tokens})")
    parser.add_argument("--response-tokens", type=positive_int, default=default.response_tokens,
                        help=f"R (default {default.response_tokens})")
    parser.add_argument("--group-size", type=positive_int, default=default.group_size,
                        help=f"G, also the per-device batch: one group per rank (default {default.group_size})")
    parser.add_argument("--chunk-size", type=positive_int, default=default.chunk_size,
                        help=f"LongStraw's capture chunk (default {default.chunk_size})")
    parser.add_argument("--dtype", default=default.dtype, help=f"parameter dtype (default {default.dtype})")
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="turn off TRL's default activation checkpointing (the drop-in follows it)")
    parser.add_argument("--only", nargs="+", metavar="ID", default=None,
                        help=f"run only these rows ({', '.join(r.id for r in ROWS)}); default all")
    parser.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds per row before it is recorded as failed (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny-llama, P=256 (4 capture chunks of 64), R=8, G=4, every row in one pair of "
                             "processes: seconds, only that every row runs (the tests use it)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default bench/results/trl-scale-<model>-<P>-<time>.json; --smoke: under "
                             "bench/results/smoke/)")


def _default_out(shape: Shape, smoke: bool) -> str:
    if smoke:
        return default_out("trl-scale", True)
    size = f"{shape.prompt_tokens // 1024}k" if shape.prompt_tokens % 1024 == 0 else str(shape.prompt_tokens)
    return default_out(f"trl-scale-{shape.model.rstrip('/').split('/')[-1]}-{size}", False)


def missing_extra() -> list[str]:
    """The `trl` extra's packages that cannot be imported here."""
    return [name for name in NEEDED if importlib.util.find_spec(name) is None]


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of `python -m benchmarks trl-scale`: exit status 0 when every row ran."""
    check_out(args.out, args.fail)
    missing = missing_extra()
    if missing:
        print(f"python -m benchmarks trl-scale: error: it needs TRL's extra ({', '.join(missing)} not importable): "
              "pip install 'longstraw[trl]'", file=sys.stderr)
        return 1
    if args.smoke:
        shape = SHAPES["smoke"]
    else:
        shape = Shape(args.model, args.prompt_tokens, args.response_tokens, args.group_size, args.chunk_size,
                      args.dtype)
    check_model(shape.model, args.fail)
    if args.no_checkpointing:
        shape = replace(shape, gradient_checkpointing=False)
    rows = list(ROWS)
    if args.only:
        known = {row.id: row for row in ROWS}
        unknown = [i for i in args.only if i not in known]
        if unknown:
            args.fail(f"--only: unknown row(s) {', '.join(unknown)}; choose from {', '.join(known)}")
        rows = [known[i] for i in dict.fromkeys(args.only)]
    # DDP rows before FSDP rows: in a shared --smoke pair, accelerate's FSDP setting must not precede a DDP row.
    rows.sort(key=lambda row: row.fsdp)
    out = args.out or _default_out(shape, args.smoke)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    document: dict[str, Any] = {
        "bench": "trl-scale", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "shape": asdict(shape),
        "smoke": args.smoke, "world": WORLD, "timeout_s": args.timeout, "optimizer": "sgd (no momentum: no state)",
        "trl_compact_head": True, "machine": machine_info("cpu"),
        "rows_per_process_pair": "all (smoke)" if args.smoke else 1, "results": [],
    }
    print(f"bench trl-scale: {shape.model} {shape.dtype}, P={shape.prompt_tokens} R={shape.response_tokens} "
          f"G={shape.group_size}, {len(rows)} rows on {WORLD} processes each "
          f"({'one pair for all' if args.smoke else 'a fresh pair per row'})", file=sys.stderr, flush=True)
    batches = [rows] if args.smoke else [[row] for row in rows]
    for batch in batches:
        for row, run in zip(batch, run_pair(shape, batch, args.timeout, args.smoke)):
            entry = summarize_row(shape, row, run)
            entry["load_average_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
            document["results"].append(entry)
            progress = (f"step peak {mib_text(entry['step_peak_bytes'])} MiB, {entry['time_s']:.1f} s"
                        if entry["status"] == "ok" else f"FAILED: {entry['error']}")
            print(f"  {row.label:<24} {progress}", file=sys.stderr, flush=True)
            write_json(out + ".tmp", document)
    document["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    document["checks"] = checks(document["results"])
    contended = [r for r in document["results"] if r.get("status") == "ok" and busy(r)]
    if contended and not args.smoke:
        document["notes"] = [f"{len(contended)} rows ran while other processes competed for the CPU: their times "
                             "are inflated (peaks are not)"]
    written = write_results(out, document, "bench trl-scale")
    if written is None:
        return 1
    os.remove(out + ".tmp")
    if args.smoke:
        print("\n".join(f"{r['label']}: {r['status']}" for r in document["results"]))
        print(SMOKE_NOTE)
    else:
        print(format_table(document))
    for note in document.get("notes", []):
        print(f"note: {note}")
    print(f"results: {written}")
    return 0 if all(r["status"] == "ok" for r in document["results"]) else 1


BENCHMARKS = (
    Benchmark(
        name="trl-scale", help="TRL's GRPOTrainer and the drop-in on 2 processes: DDP, FSDP2, context parallelism",
        description="trl.GRPOTrainer (DDP, FSDP2) and LongStrawGRPOTrainer (DDP, FSDP2, FSDP2 + cp 2, and the "
                    "same gathering a layer at a time), each as 2 fresh CPU processes (gloo) training one group per "
                    "rank for one optimizer step: per-rank peak memory, tensors at rest, prompt state, step time, "
                    "beside `longstraw plan`'s forecast; table and JSON. Needs the trl extra.",
        add_arguments=add_arguments, run=run_from_args, table=format_table,
        checks=lambda document: checks(document["results"]),
    ),
)
