"""`python -m benchmarks verl`: the peak memory of verl's own actor update against LongStraw's engine in verl, side by
side, each row in a fresh CPU process (`--smoke`: every row in one process, LongStraw's first).

Rows (every one verl's `TrainingWorker`, fsdp2 on a 1-rank gloo group, float32, SGD without momentum, one
`train_mini_batch` of one prompt's G responses: `verl_worker.py` says exactly what runs and what is measured):

* verl's `FSDPEngineWithLMHead`, micro-batch G, verl's default `use_remove_padding=True`: the G rows packed into one
  sequence of G (P + R) tokens, forward and backward at once;
* the same, `use_remove_padding=False`: the G rows as one padded (G, P + R) batch (no padding here: every row has
  the same length), which on CPU avoids the N x N mask that transformers' sdpa builds for a packed sequence;
* verl, micro-batch 1 (packed: one row at a time, one sequence, no mask), verl's lowest-memory setting;
* `LongStrawFSDPEngine` with LONGSTRAW_PLAN=exact (verl's gradient) and with detach (the prompt state a constant),
  LONGSTRAW_CHUNK_SIZE the shape's chunk.

Default shape: b1-llama (Bench B1's preset), P = 8192, G = 8 responses of R = 128 tokens, capture chunk 1024. verl
computes the log-probs of every position of a sequence, prompt included, so its micro-batch-G rows hold several
(G (P + R), V) float32 tensors (V = 32000 for b1-llama): about 40 GiB at the default shape, more than most hosts
have. `--max-memory` stops a row whose RSS passes it (default 80% of the memory available when the bench starts) and
records it as over the limit, so the bench cannot take down the host; docs/benchmarks.md ran a smaller P.

Per row: the update's peak (VmHWM above the RSS just before `train_mini_batch`, reset there), its ratio to verl's
micro-batch-G row (verl's default), the process's absolute VmHWM, wall and CPU time, CPU pressure, and LongStraw's
prompt state. Times: other processes may compete for the cores (`cpu_pressure`); peaks do not depend on the load.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.common import (
    B1,
    GIB,
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
from benchmarks.launch import describe_exit, free_port, rank_env, worker_command, worker_env
from benchmarks.machine import machine_info
from benchmarks.registry import Benchmark
from longstraw.choices import PRESET_NAMES
from longstraw.planner import positive_int

DEFAULT_TIMEOUT_S = 3600.0  # per row
MEMORY_SHARE = 0.8  # default --max-memory: this share of MemAvailable when the bench starts
POLL_S = 0.05  # how often the parent reads a worker's RSS
BASE_ROW = "verl-mbG"  # the ratio's denominator: verl's own update at its defaults


@dataclass(frozen=True)
class Shape:
    """The one shape every row runs."""

    model: str
    prompt_tokens: int
    response_tokens: int
    group_size: int
    chunk_size: int  # LongStraw's capture chunk (LONGSTRAW_CHUNK_SIZE)
    dtype: str = "float32"


SHAPES = {
    "default": Shape(B1.model, 8192, 128, 8, chunk_size=1024),
    "smoke": Shape("tiny-llama", 256, 8, 4, chunk_size=64),
}


@dataclass(frozen=True)
class Row:
    """One row: whose engine, verl's micro-batch (0: G), verl's use_remove_padding, LongStraw's plan."""

    id: str
    label: str
    engine: str  # "verl" or "longstraw"
    micro_batch: int = 0  # rows per verl micro-batch; 0 = G (LongStraw's engine takes the mini-batch as one group)
    remove_padding: bool = True
    plan: str | None = None


ROWS = (
    Row("verl-mbG", "verl, micro-batch G (packed)", "verl"),
    Row("verl-mbG-padded", "verl, micro-batch G, padded", "verl", remove_padding=False),
    Row("verl-mb1", "verl, micro-batch 1", "verl", micro_batch=1),
    Row("longstraw-exact", "LongStraw exact", "longstraw", plan="exact"),
    Row("longstraw-detach", "LongStraw detach", "longstraw", plan="detach"),
)


def worker_row(shape: Shape, row: Row) -> dict[str, Any]:
    """The row as the worker reads it (micro-batch resolved)."""
    return asdict(row) | {"micro_batch": row.micro_batch or shape.group_size}


# ---------------------------------------------------------------- running a row


def _rss_bytes(pid: int) -> int:
    """A live process's VmRSS (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None off Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def run_rows(shape: Shape, rows: list[Row], timeout_s: float | None, smoke: bool,
             max_memory: int | None) -> list[dict[str, Any]]:
    """Run `rows` in one fresh worker process; one entry per row: its measurement (status "ok"), or status
    "over_memory" (the worker's RSS passed `max_memory`: stopped) or "failed", with the error and the output's tail.
    Never raises."""
    job = {"shape": asdict(shape), "rows": [worker_row(shape, row) for row in rows]}
    env = rank_env(worker_env(B1.malloc_mmap_threshold, smoke), 0, 1, free_port())
    for name in ("LONGSTRAW_PLAN", "LONGSTRAW_CHUNK_SIZE", "LONGSTRAW_MICRO_BATCH", "LONGSTRAW_CHECKPOINT"):
        env.pop(name, None)  # the worker sets the first two per row; the others keep the integration's defaults
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out, log = os.path.join(tmp, "rows.json"), os.path.join(tmp, "output.txt")
        with open(log, "w") as sink:
            proc = subprocess.Popen(worker_command("verl_worker", json.dumps(job), out),
                                    env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=tmp)
            error, status, peak_rss = None, "failed", 0
            try:
                while proc.poll() is None:
                    rss = _rss_bytes(proc.pid)
                    peak_rss = max(peak_rss, rss)
                    if max_memory is not None and rss > max_memory:
                        proc.kill()
                        status = "over_memory"
                        error = (f"stopped: its RSS passed --max-memory {max_memory / GIB:.1f} GiB "
                                 f"({rss / GIB:.1f} GiB)")
                        break
                    if timeout_s is not None and time.perf_counter() - t0 > timeout_s:
                        proc.kill()
                        error = f"timed out after {timeout_s:.0f} s"
                        break
                    time.sleep(POLL_S)
                proc.wait()
            except BaseException:  # Ctrl-C or SIGTERM raised here: end the worker before leaving
                proc.kill()
                proc.wait()
                raise
        if error is None and proc.returncode:
            error = describe_exit(proc.returncode)
        measured: list[dict[str, Any]] = []
        if os.path.exists(out):
            with open(out) as f:
                measured = json.load(f)
        with open(log, errors="replace") as f:
            tail = f.read()[-STDERR_TAIL:]
    process_s = time.perf_counter() - t0
    entries: list[dict[str, Any]] = []
    for index, row in enumerate(rows):
        if index < len(measured):
            entries.append({**measured[index], "status": "ok", "process_s": process_s,
                            "sampled_peak_rss_bytes": peak_rss})
        else:
            entries.append({"id": row.id, "status": status if index == len(measured) else "failed",
                            "error": (error or "the worker wrote no result") if index == len(measured)
                            else "not run: an earlier row of its process failed",
                            "output_tail": tail, "process_s": process_s, "sampled_peak_rss_bytes": peak_rss})
    return entries


# ---------------------------------------------------------------- expectations and checks


def expectations(shape: Shape, vocab: int | None, prompt_state: int | None) -> dict[str, Any]:
    """What each row must hold at least, from the shape: verl's log-probs cover every position, so one full
    sequence's (P + R, V) float32 logits per row of a micro-batch; a packed micro-batch of G rows (on CPU, with sdpa)
    also an N x N boolean mask, held through the update, and a float32 copy of it inside each attention call;
    LongStraw the prompt state and one response's logits (R, V)."""
    out: dict[str, Any] = {"vocab_size": vocab, "prompt_state_bytes": prompt_state}
    if vocab:
        full = (shape.prompt_tokens + shape.response_tokens) * vocab * 4
        n = shape.group_size * (shape.prompt_tokens + shape.response_tokens)
        out.update(full_sequence_logits_bytes=full, group_logits_bytes=shape.group_size * full,
                   response_logits_bytes=shape.response_tokens * vocab * 4, packed_tokens=n,
                   packed_mask_bool_bytes=n * n, packed_mask_float_copy_bytes=4 * n * n)
    return out


def checks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each LongStraw row against each verl row: whether its update peak is lower (rows that ran)."""
    by_id = {r["id"]: r for r in results if r.get("status") == "ok"}
    out: dict[str, Any] = {}
    for ours in ("longstraw-exact", "longstraw-detach"):
        for theirs in ("verl-mbG", "verl-mbG-padded", "verl-mb1"):
            if ours in by_id and theirs in by_id:
                out[f"{ours}_below_{theirs}"] = by_id[ours]["update_peak_bytes"] < by_id[theirs]["update_peak_bytes"]
    return out


# ---------------------------------------------------------------- the table


TABLE_NOTE = (
    "peak: VmHWM above the RSS just before train_mini_batch (model, worker and batch built), the whole update "
    "(forward, backward, gradient reduction, clipping, SGD step); ratio = peak / verl micro-batch G (packed), "
    "verl's defaults; VmHWM: the process's absolute high-water mark (interpreter, libraries, model); state: "
    "LongStraw's prompt state for the group; time s: the update's wall time (CPU pr.: the share of it during which a "
    "runnable task waited for a core: other load inflates times, not peaks); CPU s: the process's CPU time in the "
    "update. One CPU process, float32, FSDP2 on 1 rank; verl's defaults (per-layer activation checkpointing, sdpa "
    "here); LongStraw's engine runs the group under sharded_compute, which gathers every parameter once and holds "
    "the full gradient until one reduce-scatter (on 1 rank: a full copy of the parameters and of the gradient)")


def floor_lines(document: dict[str, Any]) -> list[str]:
    """The notes saying what each row must hold (`expectations`, computed from the document's shape and vocabulary)."""
    stored = document.get("expectations", {})
    shape = document["shape"]
    if not stored.get("vocab_size"):
        return []
    e = expectations(Shape(**shape), stored["vocab_size"], stored.get("prompt_state_bytes"))
    g, p, r = shape["group_size"], shape["prompt_tokens"], shape["response_tokens"]
    lines = [
        f"expected: verl scores every position, prompt included: one sequence's (P+R) x V float32 logits are "
        f"{e['full_sequence_logits_bytes'] / MIB:.1f} MiB, G of them {e['group_logits_bytes'] / MIB:.1f} MiB; its "
        f"peak holds a few such tensors (logits, log-softmax, their gradients) for all G rows at once (micro-batch G) "
        f"or one row (micro-batch 1), plus with checkpointing each layer's input per token",
        f"packed micro-batch G on CPU (sdpa): transformers builds an N x N boolean block-causal mask for N = G(P+R) = "
        f"{e['packed_tokens']} tokens, {e['packed_mask_bool_bytes'] / MIB:.1f} MiB held through the update, and "
        f"torch's sdpa a float32 copy inside each attention call ({e['packed_mask_float_copy_bytes'] / MIB:.1f} MiB, "
        f"transient), and computes all N^2 scores (the row's time); flash_attention_2's varlen kernel on a GPU does "
        f"neither; the padded row shows verl without them",
    ]
    state = e.get("prompt_state_bytes")
    params = next((r["model"]["param_bytes"] for r in document["results"] if "model" in r), None)
    lines.append(
        f"LongStraw: prompt state ({'-' if state is None else f'{state / MIB:.1f} MiB'}) + one response of R={r} "
        f"(its logits {e['response_logits_bytes'] / MIB:.1f} MiB) at a time, the prompt encoded once instead of "
        f"G={g} times (P={p}); exact adds the state's gradient and one capture chunk's recompute; under "
        f"sharded_compute also a gathered copy of the parameters and their full gradient"
        + ("" if params is None else f" ({params / MIB:.1f} MiB each)"))
    return lines


def format_table(document: dict[str, Any]) -> str:
    shape = document["shape"]
    results: list[dict[str, Any]] = document["results"]
    base = next((r for r in results if r["id"] == BASE_ROW and r.get("status") == "ok"), None)
    width = max(len(str(r.get("label", r["id"]))) for r in results)
    lines = [f"{shape['model']} {shape['dtype']}, P={shape['prompt_tokens']} R={shape['response_tokens']} "
             f"G={shape['group_size']}, verl TrainingWorker (fsdp2, 1 CPU process), one train_mini_batch, SGD, "
             f"LongStraw chunk {shape['chunk_size']}; MiB",
             f"{'row':<{width}}  {'peak':>9} {'ratio':>6} {'VmHWM':>9} {'time s':>8} {'CPU pr.':>7} {'CPU s':>7} "
             f"{'state':>7}"]
    for r in results:
        label = str(r.get("label", r["id"]))
        if r.get("status") != "ok":
            lines.append(f"{label:<{width}}  {'OVER LIMIT' if r.get('status') == 'over_memory' else 'FAILED'}: "
                         f"{r.get('error')}")
            continue
        ratio = "-" if base is None else f"{r['update_peak_bytes'] / base['update_peak_bytes']:.3f}"
        pressure = r.get("cpu_pressure")
        state = r.get("prompt_state_bytes")
        lines.append(
            f"{label:<{width}}  {mib_text(r['update_peak_bytes'])} {ratio:>6} {mib_text(r['absolute_hwm_bytes'])} "
            f"{r['time_s']:8.1f} {'-' if pressure is None else f'{pressure:.0%}':>7} {r['cpu_time_s']:7.1f} "
            f"{'-' if state is None else f'{state / MIB:.1f}':>7}{'  (host busy)' if busy(r) else ''}")
    lines += [textwrap.fill(line, width=118, subsequent_indent="  ") for line in floor_lines(document)]
    lines.append(textwrap.fill(TABLE_NOTE, width=118))
    return "\n".join(lines)


# ---------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = SHAPES["default"]
    parser.add_argument("--model", default=default.model,
                        help=f"a preset ({', '.join(PRESET_NAMES)}) or a local directory (default "
                             f"{default.model}, Bench B1's)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=default.prompt_tokens,
                        help=f"P (default {default.prompt_tokens})")
    parser.add_argument("--response-tokens", type=positive_int, default=default.response_tokens,
                        help=f"R (default {default.response_tokens})")
    parser.add_argument("--group", "--group-size", dest="group_size", type=positive_int, default=default.group_size,
                        help=f"G responses of the one prompt (default {default.group_size})")
    parser.add_argument("--chunk-size", type=positive_int, default=default.chunk_size,
                        help=f"LongStraw's capture chunk, LONGSTRAW_CHUNK_SIZE (default {default.chunk_size})")
    parser.add_argument("--only", nargs="+", metavar="ID", default=None,
                        help=f"run only these rows ({', '.join(r.id for r in ROWS)}); default all")
    parser.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds per row before it is recorded as failed (default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--max-memory", type=positive_float, default=None, metavar="GIB",
                        help=f"stop a row whose RSS passes this many GiB and record it as over the limit (default "
                             f"{MEMORY_SHARE * 100:.0f}%% of the memory available when the bench starts)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny-llama, P=256, R=8, G=4, chunk 64, every row in one process: seconds, only "
                             "that every row runs (the tests use it)")
    parser.add_argument("--out", default=None,
                        help="JSON path (default bench/results/verl-<model>-<P>-<time>.json; --smoke: under "
                             "bench/results/smoke/)")


def _default_out(shape: Shape, smoke: bool) -> str:
    if smoke:
        return default_out("verl", True)
    size = f"{shape.prompt_tokens // 1024}k" if shape.prompt_tokens % 1024 == 0 else str(shape.prompt_tokens)
    return default_out(f"verl-{shape.model.rstrip('/').split('/')[-1]}-{size}", False)


def missing_verl() -> str | None:
    """Why verl's update cannot run here (verl not importable), or None."""
    if importlib.util.find_spec("verl") is None:
        return ("it needs verl (pip install 'longstraw[verl]'; verl 0.9 pins transformers < 5.11, so a venv of its "
                "own: constraints-verl.txt has versions that work)")
    return None


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of `python -m benchmarks verl`: exit status 0 when every row ran."""
    why = missing_verl()
    if why:
        print(f"python -m benchmarks verl: error: {why}", file=sys.stderr)
        return 1
    check_out(args.out, args.fail)
    shape = SHAPES["smoke"] if args.smoke else Shape(args.model, args.prompt_tokens, args.response_tokens,
                                                     args.group_size, args.chunk_size)
    check_model(shape.model, args.fail)
    rows = list(ROWS)
    if args.only:
        known = {row.id: row for row in ROWS}
        unknown = [i for i in args.only if i not in known]
        if unknown:
            args.fail(f"--only: unknown row(s) {', '.join(unknown)}; choose from {', '.join(known)}")
        rows = [known[i] for i in dict.fromkeys(args.only)]
    available = available_memory_bytes()
    max_memory = (int(args.max_memory * GIB) if args.max_memory is not None
                  else int(available * MEMORY_SHARE) if available else None)
    out = args.out or _default_out(shape, args.smoke)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    document: dict[str, Any] = {
        "bench": "verl", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "shape": asdict(shape), "smoke": args.smoke,
        "timeout_s": args.timeout, "max_memory_bytes": max_memory, "memory_available_at_start_bytes": available,
        "optimizer": "sgd (no momentum: no state)", "loss_agg_mode": "token-mean", "kl": False,
        "malloc_mmap_threshold": B1.malloc_mmap_threshold, "machine": machine_info("cpu"),
        "verl": _version("verl"), "rows": [worker_row(shape, row) for row in rows],
        "rows_per_process": "all (smoke)" if args.smoke else 1, "results": [],
    }
    print(f"bench verl: {shape.model} {shape.dtype}, P={shape.prompt_tokens} R={shape.response_tokens} "
          f"G={shape.group_size}, {len(rows)} rows, a fresh process each"
          + (f", stopped above {max_memory / GIB:.1f} GiB RSS" if max_memory else ""), file=sys.stderr, flush=True)
    # A real run: a fresh process per row. --smoke: one process for all (verl's import alone takes seconds),
    # LongStraw's rows first, so that heap reused from an earlier row can only lower verl's peaks, not LongStraw's.
    batches = ([sorted(rows, key=lambda row: row.engine != "longstraw")] if args.smoke
               else [[row] for row in rows])
    for batch in batches:
        for row, run in zip(batch, run_rows(shape, batch, args.timeout, args.smoke, max_memory)):
            entry = {"label": row.label, **run}
            entry["load_average_after"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
            document["results"].append(entry)
            progress = (f"peak {mib_text(entry['update_peak_bytes'])} MiB, {entry['time_s']:.1f} s"
                        if entry["status"] == "ok" else f"{entry['status'].upper()}: {entry['error']}")
            print(f"  {row.label:<30} {progress}", file=sys.stderr, flush=True)
            write_json(out + ".tmp", document)
    order = {row.id: k for k, row in enumerate(rows)}
    document["results"].sort(key=lambda r: order[r["id"]])
    document["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    ran = [r for r in document["results"] if r.get("status") == "ok"]
    vocab = next((r["model"]["vocab_size"] for r in ran), None)
    state = next((r["prompt_state_bytes"] for r in ran if r.get("prompt_state_bytes")), None)
    document["expectations"] = expectations(shape, vocab, state)
    document["checks"] = checks(document["results"])
    contended = [r for r in ran if busy(r)]
    if contended and not args.smoke:
        document["notes"] = [f"{len(contended)} rows ran while other processes competed for the CPU: their times "
                             "are inflated (peaks are not)"]
    written = write_results(out, document, "bench verl")
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


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


BENCHMARKS = (
    Benchmark(
        name="verl", help="verl's own actor update against LongStraw's engine in verl: peak memory, side by side",
        description="verl's TrainingWorker (FSDP2, 1 CPU process, float32, SGD) running one train_mini_batch of one "
                    "prompt's group with verl's FSDPEngineWithLMHead (micro-batch G packed and padded, micro-batch "
                    "1) and with LongStrawFSDPEngine (exact, detach), each row in a fresh process: update peak "
                    "memory, time, CPU pressure, prompt state; table and JSON. Needs verl (its own venv: verl 0.9 "
                    "pins transformers < 5.11).",
        add_arguments=add_arguments, run=run_from_args, table=format_table,
        checks=lambda document: checks(document["results"]),
    ),
)
