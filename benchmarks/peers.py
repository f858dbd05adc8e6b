"""`python -m benchmarks peers`: LongStraw against what users run today, on one shape, in one run.

Configurations on the same model weights and the same group (prompt, G responses, advantages: `benchmarks/worker.py`'s
`make_group`), each run twice, each time in a fresh process:

* the peak run: glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_ = 128 KiB, as every bench: peaks repeat within
  1 MiB, `benchmarks/common.py`); its peak (VmHWM above the loaded model) is the table's peak;
* the timing run: glibc's default allocator (MALLOC_MMAP_THRESHOLD_ removed from the environment), what users run;
  its wall time is the table's time. Under the fixed threshold every allocation above 128 KiB is a fresh mmap,
  page-faulted on first touch, which penalizes the configurations that allocate more bytes per step (`exact`
  ~4.7 GB per step at b1 against Prefix Grouper's 3.4 GB: 4.9-5.4 s against 4.0-4.5 s in one process, 3.8 s
  against 3.7-3.9 s with the default allocator). The JSON keeps both times (`time_s` from the timing run,
  `time_fixed_threshold_s` from the peak run) and each run's CPU pressure (`cpu_pressure`: the timing run's).

* LongStraw `detach` and `exact`: `benchmarks/worker.py`, one `backward_group` call.
* TRL's GRPO training step with per-device batch G (one micro-batch) and with batch 1 x G gradient-accumulation
  steps, each without and with activation checkpointing (TRL's default is with): a real `trl.GRPOTrainer`, only its
  generation replaced by the group, its LM head scoring only the completions as on CUDA (`--trl-all-positions`: as
  on CPU, every position; `benchmarks/peers_worker.py` says exactly what runs).
* Prefix Grouper (PyPI `prefix-grouper`), without and with activation checkpointing: its own grouping and attention
  split through an SDPA adapter on CPU, LongStraw's log-prob head and grpo loss (`peers_worker.py`). Optional:
  where it is not importable it is recorded as "not installed" (e.g. installed with `pip install --target DIR
  prefix-grouper` and found through `PYTHONPATH=DIR`).

Per configuration: status, peak MiB, time (one group's loss forward and backward, no optimizer step, wall clock),
time over `exact`'s, and the peak run's time under the fixed threshold. Then LongStraw against the strongest peer
configuration: the one with the lowest peak, and the fastest. A configuration that fails (error, out of memory,
timeout) is recorded with its stderr tail and the run goes on; one whose peak run failed gets no timing run, and
one whose timing run failed keeps its peak with no time (`timing_run` in the JSON says why).

Every worker inherits this process's environment, OMP_WAIT_POLICY included (the `longstraw` command sets PASSIVE
unless the user set it: `cli.passive_openmp_wait`); the document records it (`machine.omp_wait_policy`) and the
table's header prints it. `--neighbours N` runs N busy-loop processes (`python -c "while True: pass"`) throughout
the measured configurations, a reproducible busy host (`common.busy_neighbours`); the count is recorded and printed.

`--shape b1` (default): b1-llama, fp32, CPU, P = 4096, R = 256, G = 8. `--smoke` (= `--shape smoke`): tiny-llama,
P = 64, R = 8, G = 4, seconds per configuration, only that every configuration runs (used by the tests): one
thread, LongStraw's rows in one shared worker, and no timing run (`time_s` is the peak run's, under the fixed
threshold).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks.common import (
    B1,
    MIB,
    PEAK_RESOLUTION,
    RESULTS_FILE,
    SMOKE_NOTE,
    STDERR_TAIL,
    TIMING_THRESHOLD,
    busy,
    check_out,
    combine_runs,
    default_out,
    non_negative_int,
    peak_text,
    positive_float,
    run_batch,
    write_json,
    write_results,
)
from benchmarks.flops import NOTE as FLOP_NOTE
from benchmarks.flops import checkpointed, group_flops, preset_costs
from benchmarks.launch import busy_neighbours, describe_exit, worker_command, worker_env
from benchmarks.machine import machine_info
from benchmarks.registry import Benchmark
from longstraw.planner import positive_int

DEFAULT_TIMEOUT_S = 1800.0  # per configuration; TRL's unchecked batch of 8 at P = 4096 takes well under a minute
PEAK_THRESHOLD = B1.malloc_mmap_threshold  # the peak run's fixed glibc mmap threshold (bytes)


@dataclass(frozen=True)
class PeersShape:
    """The one shape every configuration runs."""

    model: str
    prompt_tokens: int
    response_tokens: int
    group_size: int
    chunk_size: int  # LongStraw's capture chunk
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0


SHAPES = {
    "b1": PeersShape("b1-llama", 4096, 256, 8, chunk_size=2048),
    "smoke": PeersShape("tiny-llama", 64, 8, 4, chunk_size=32),
}


KEEP_ALL = 1 << 20


@dataclass(frozen=True)
class Configuration:
    """One row of the table: `peer` "longstraw" (`plan`), "trl" (`batch` per device, G / batch accumulation steps)
    or "prefix_grouper"; `checkpoint`: activation checkpointing."""

    id: str
    label: str
    peer: str
    plan: str | None = None
    batch: int | None = None
    checkpoint: bool = False
    keep_prompt_graph: int = 0  # LongStraw exact: capture chunks whose graph is kept (backward_group(...))
    micro_batch: int = 1  # LongStraw: responses replayed at once


def configurations(g: int) -> list[Configuration]:
    """The table's rows for group size `g`, LongStraw first (`exact` is the time reference)."""
    rows = [Configuration("longstraw-detach", "LongStraw detach", "longstraw", plan="detach"),
            Configuration("longstraw-exact", "LongStraw exact", "longstraw", plan="exact"),
            # Every capture chunk's graph kept: the prompt backward recomputes nothing (a Pareto knob: time for
            # the prompt's activations; KEEP_ALL >= any shape's chunk count).
            Configuration("longstraw-exact-keep", "LongStraw exact, prompt graph kept", "longstraw", plan="exact",
                          keep_prompt_graph=KEEP_ALL),
            # ... and 4 responses replayed at once: the fast end of exact's Pareto front (bench pareto).
            Configuration("longstraw-exact-keep-k4", "LongStraw exact, prompt graph kept, 4 at once", "longstraw",
                          plan="exact", keep_prompt_graph=KEEP_ALL, micro_batch=4)]
    for batch, what in ((g, f"{g} per batch"), (1, f"1 per batch x {g} accumulation")):
        tag = f"trl-b{g}" if batch == g else f"trl-b1x{g}"
        rows.append(Configuration(tag, f"TRL, {what}", "trl", batch=batch))
        rows.append(Configuration(f"{tag}-ckpt", f"TRL, {what} + checkpointing", "trl", batch=batch,
                                  checkpoint=True))
    rows.append(Configuration("prefix-grouper", "Prefix Grouper", "prefix_grouper"))
    rows.append(Configuration("prefix-grouper-ckpt", "Prefix Grouper + activation checkpointing", "prefix_grouper",
                              checkpoint=True))
    return rows


# ---------------------------------------------------------------- running one configuration


def run_peer(shape: PeersShape, row: Configuration, timeout_s: float | None, smoke: bool = False,
             mmap_threshold: int = PEAK_THRESHOLD, trl_compact_head: bool = True) -> dict[str, Any]:
    """Run a TRL or Prefix Grouper configuration in a fresh `benchmarks/peers_worker.py`; its result (status "ok",
    "not installed" or "failed", with the error and stderr tail), never raising. mmap_threshold: glibc's, 0 for its
    default allocator (`common.worker_env`). trl_compact_head: TRL's LM head scores only the completions, as on
    CUDA (`peers_worker._compact_head_on_every_device`)."""
    payload = {"peer": row.peer, "model": shape.model, "dtype": shape.dtype, "device": shape.device,
               "prompt_tokens": shape.prompt_tokens, "response_tokens": shape.response_tokens,
               "group_size": shape.group_size, "seed": shape.seed, "batch": row.batch or shape.group_size,
               "checkpoint": row.checkpoint, "trl_compact_head": trl_compact_head}
    entry: dict[str, Any] = {}
    cmd = worker_command("peers_worker", json.dumps(payload))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=worker_env(mmap_threshold, smoke))
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
        return {"status": "failed", "error": f"timed out after {timeout_s} s", "stderr_tail": stderr[-STDERR_TAIL:],
                "process_s": time.perf_counter() - t0}
    entry["process_s"] = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        error = describe_exit(proc.returncode) if proc.returncode != 0 else "worker printed no result"
        last = proc.stderr.strip().splitlines()[-1:] if proc.stderr.strip() else []
        return {**entry, "status": "failed", "error": f"{error}{': ' + last[0] if last else ''}",
                "stderr_tail": proc.stderr[-STDERR_TAIL:]}
    try:
        measurement = json.loads(lines[-1])
    except json.JSONDecodeError as err:
        return {**entry, "status": "failed", "error": f"unreadable worker output: {err}",
                "stderr_tail": proc.stderr[-STDERR_TAIL:]}
    return {**entry, **measurement}


def run_longstraw(shape: PeersShape, rows: list[Configuration], timeout_s: float | None,
                  smoke: bool = False, mmap_threshold: int = PEAK_THRESHOLD) -> list[dict[str, Any]]:
    """LongStraw's rows through `benchmarks/worker.py` (a fresh worker each; a smoke run shares one), with glibc's mmap
    threshold `mmap_threshold` (0: its default allocator)."""
    config = replace(B1, model=shape.model, dtype=shape.dtype, device=shape.device, prompt_tokens=shape.prompt_tokens,
                     response_tokens=shape.response_tokens, chunk_size=shape.chunk_size, seed=shape.seed,
                     timeout_s=timeout_s, malloc_mmap_threshold=mmap_threshold)
    jobs = [(replace(config, keep_prompt_graph=row.keep_prompt_graph, micro_batch=row.micro_batch), str(row.plan),
             shape.group_size) for row in rows]
    return run_batch(jobs, isolate=not smoke)


def run_configuration(shape: PeersShape, row: Configuration, timeout_s: float | None, mmap_threshold: int,
                      smoke: bool = False, trl_compact_head: bool = True) -> dict[str, Any]:
    """One run of one configuration in a fresh process (LongStraw's worker or the peers' worker), never raising."""
    if row.peer == "longstraw":
        (entry,) = run_longstraw(shape, [row], timeout_s, smoke, mmap_threshold)
        return entry
    return run_peer(shape, row, timeout_s, smoke, mmap_threshold, trl_compact_head)


# ---------------------------------------------------------------- the table


def _ok(entry: dict[str, Any]) -> bool:
    return entry.get("status") == "ok" and float(entry.get("peak_bytes", 0)) >= PEAK_RESOLUTION


def _timed(entry: dict[str, Any]) -> bool:
    """Ran, with a time (not when its timing run failed)."""
    return entry.get("status") == "ok" and entry.get("time_s") is not None


def _ours_name(entry: dict[str, Any]) -> str:
    """A LongStraw row's short name in the summary: its plan, "+keep" when the capture graphs were kept, "+kN" when N
    responses were replayed at once."""
    k = entry.get("micro_batch") or 1
    return str(entry["plan"]) + ("+keep" if entry.get("keep_prompt_graph") else "") + (f"+k{k}" if k > 1 else "")


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """time / exact per configuration, and LongStraw against the strongest peer configuration: the lowest peak
    (peer peak / ours: how many times less memory LongStraw uses) and the fastest (peer time / ours: > 1, LongStraw
    is faster). Empty parts where the needed configurations did not run."""
    by_id = {str(r["id"]): r for r in results}
    exact = by_id.get("longstraw-exact")
    summary: dict[str, Any] = {}
    if exact is not None and _timed(exact):
        summary["time_over_exact"] = {str(r["id"]): float(r["time_s"]) / float(exact["time_s"])
                                      for r in results if _timed(r)}
    for what, key in (("memory", "peak_bytes"), ("time", "time_s")):
        ours = [r for r in results if r["peer"] == "longstraw" and _ok(r) and r.get(key) is not None]
        peers = [r for r in results if r["peer"] != "longstraw" and _ok(r) and r.get(key) is not None]
        if ours and peers:
            best = min(peers, key=lambda r: float(r[key]))
            summary[f"strongest_peer_{what}"] = {
                "id": best["id"], "label": best["label"], key: best[key],
                "peer_over_longstraw": {_ours_name(r): float(best[key]) / float(r[key]) for r in ours},
            }
    return summary


def flops_over_exact(shape: PeersShape, rows: list[Configuration]) -> dict[str, float]:
    """Per configuration, its FLOP count over LongStraw exact's (`benchmarks/flops.py`: TRL runs every sequence
    whole, Prefix Grouper and exact with every prompt graph kept the prompt once with grad; checkpointing adds its
    forward again); empty for a model the
    count does not cover. The floor its time / exact is read against."""
    c = preset_costs(shape.model)
    if c is None:
        return {}
    dims = (shape.prompt_tokens, shape.response_tokens, shape.group_size)
    exact = group_flops(c, "exact", *dims)
    out = {}
    for row in rows:
        method = {"trl": "standard", "prefix_grouper": "shared"}.get(row.peer, row.plan or "exact")
        if row.keep_prompt_graph >= KEEP_ALL:  # every capture chunk's graph kept: no recompute of the prompt
            method = "shared"
        count = group_flops(c, method, *dims) + (checkpointed(c, method, *dims) if row.checkpoint else 0)
        out[row.id] = count / exact
    return out


TABLE_NOTE = (
    "peak: one group's loss forward and backward (no optimizer step), VmHWM above the loaded model, with glibc's "
    "mmap threshold fixed at {threshold} KiB (repeatable peaks); time s: the same step's wall time in a second fresh "
    "process with glibc's default allocator, what users run; fixed-thr s: the peak run's time, where every "
    "allocation over the threshold is a fresh page-faulted mmap (slower for plans that allocate more bytes per step)")


def header(document: dict[str, Any]) -> str:
    """The table's first line: the shape, the busy-loop neighbours and the OpenMP wait policy the workers ran with."""
    shape = document["shape"]
    machine = document.get("machine", {})
    return (f"bench peers: {shape['model']} {shape['dtype']} {shape['device']}, P={shape['prompt_tokens']} "
            f"R={shape['response_tokens']} G={shape['group_size']}; busy-loop neighbours: "
            f"{document.get('neighbours', 0)}; OMP_WAIT_POLICY: {machine.get('omp_wait_policy', 'unset')}")


def _seconds(value: Any) -> str:
    return f"{'-':>9}" if value is None else f"{float(value):9.2f}"


def _flops(flops: dict[str, float], r: dict[str, Any]) -> str:
    value = flops.get(str(r["id"]))
    return "-" if value is None else f"{value:.2f}"


def format_table(document: dict[str, Any]) -> str:
    """The table: a header line (`header`) when the document has its shape, a row per configuration (time / exact
    and fixed-thr s: '-' where not measured), the strongest peer configurations, and what the columns measure."""
    results: list[dict[str, Any]] = document["results"]
    summary: dict[str, Any] = document["summary"]
    over: dict[str, float] = summary.get("time_over_exact", {})
    flops: dict[str, float] = summary.get("flops_over_exact", {})
    width = max(len(str(r["label"])) for r in results)
    lines = [header(document)] if "shape" in document else []
    lines.append(f"{'configuration':<{width}}  {'status':<13} {'peak MiB':>9} {'time s':>9} {'time / exact':>12} "
                 f"{'fixed-thr s':>11} {'FLOPs / exact':>13}")
    for r in results:
        if r.get("status") == "ok":
            ratio = over.get(str(r["id"]))
            cells = (f"{peak_text(float(r['peak_bytes']))} {_seconds(r.get('time_s'))} "
                     f"{'-' if ratio is None else f'{ratio:.2f}':>12} {_seconds(r.get('time_fixed_threshold_s')):>11}"
                     f" {_flops(flops, r):>13}{'  (host busy)' if busy(r) else ''}")
        else:
            cells = f"{'-':>9} {'-':>9} {'-':>12} {'-':>11} {_flops(flops, r):>13}"
        lines.append(f"{str(r['label']):<{width}}  {str(r.get('status')):<13} {cells}")
    for what, unit, head, verb in (("memory", "peak_bytes", "lowest-memory", "peak"),
                                   ("time", "time_s", "fastest", "time")):
        best = summary.get(f"strongest_peer_{what}")
        if not isinstance(best, dict):
            continue
        value = (f"{float(best[unit]) / MIB:.1f} MiB" if unit == "peak_bytes" else f"{float(best[unit]):.2f} s")
        ratios = ", ".join(f"{plan} {ratio:.2f}" for plan, ratio in best["peer_over_longstraw"].items())
        lines.append(f"{head} peer configuration: {best['label']} ({value}); its {verb} / LongStraw's: {ratios} "
                     f"(> 1: LongStraw ahead)")
    lines.append(textwrap.fill(TABLE_NOTE.format(threshold=PEAK_THRESHOLD // 1024), width=118))
    if flops:
        lines.append(textwrap.fill(f"FLOPs / exact: the configuration's FLOP count over exact's, the floor of its time "
                                   f"/ exact ({FLOP_NOTE}; checkpointing counts its forward again)", width=118))
    return "\n".join(lines)


# ---------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=sorted(SHAPES), default="b1",
                        help="b1: b1-llama fp32 CPU, P=4096 R=256 G=8 (default); smoke: tiny-llama, P=64 R=8 G=4")
    parser.add_argument("--smoke", action="store_true", help="the same as --shape smoke: seconds, only that "
                                                             "every configuration runs (the tests use it)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=None, help="override the shape's P")
    parser.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S,
                        help="seconds per configuration before it is recorded as failed "
                             f"(default {DEFAULT_TIMEOUT_S:g})")
    parser.add_argument("--neighbours", type=non_negative_int, default=0, metavar="N",
                        help="run N busy-loop processes (python -c 'while True: pass') during every measured "
                             "configuration: a reproducible busy host (default 0)")
    parser.add_argument("--only", nargs="+", metavar="ID", default=None,
                        help="run only these configurations, by id (as in the JSON; at the b1 shape: "
                             f"{', '.join(c.id for c in configurations(SHAPES['b1'].group_size))}; TRL's ids "
                             "carry the shape's G); default all")
    parser.add_argument("--trl-all-positions", action="store_true",
                        help="TRL's LM head as TRL runs it on CPU: every position scored, prompt included (default: "
                             "only the completions, as TRL does on CUDA; benchmarks/peers_worker.py)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/peers-<time>.json; smoke: "
                                                    "under bench/results/smoke/)")


def _progress(entry: dict[str, Any]) -> str:
    status = entry.get("status")
    if status != "ok":
        return f"{str(status).upper()}: {entry.get('error')}"
    text = f"peak {peak_text(float(entry['peak_bytes']))} MiB  "
    timing = entry.get("timing_run")
    if timing is None:
        return text + f"time {float(entry['time_s']):8.2f} s (the peak run's, fixed threshold: no timing run)"
    if timing.get("status") != "ok":
        return text + f"no time: timing run {str(timing.get('status')).upper()}: {timing.get('error')}"
    return text + (f"time {float(entry['time_s']):8.2f} s  (fixed threshold: "
                   f"{float(entry['time_fixed_threshold_s']):.2f} s)")


@contextmanager
def _announce_partial(out: str, document: dict[str, Any]) -> Iterator[None]:
    """On an interrupt or error mid-run, write the configurations finished so far to `out`.tmp (the stop may come
    between a configuration's end and its write) and say where they are."""
    try:
        yield
    except BaseException:
        if document["results"]:
            write_json(out + ".tmp", document)
            print(f"bench peers: {len(document['results'])} configuration(s) finished before it stopped; their "
                  f"results are in {out}.tmp", file=sys.stderr, flush=True)
        raise


def run_peers_bench(shape: PeersShape, out: str, timeout_s: float | None, smoke: bool = False,
                    rows: list[Configuration] | None = None, trl_compact_head: bool = True,
                    neighbours: int = 0) -> dict[str, Any]:
    """Run every configuration (a peak run, then unless smoke a timing run: module docstring) with `neighbours`
    busy-loop processes running throughout, write the JSON (after each configuration to `out`.tmp, at the end to
    `out`) and print progress on stderr; return the document."""
    rows = configurations(shape.group_size) if rows is None else rows
    document: dict[str, Any] = {
        "bench": "peers", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "shape": asdict(shape), "smoke": smoke,
        "timeout_s": timeout_s, "trl_compact_head": trl_compact_head, "neighbours": neighbours,
        "peak_run_mmap_threshold": PEAK_THRESHOLD,
        "timing_run": "skipped (smoke): time_s is the peak run's, under the fixed threshold" if smoke
                      else "glibc's default allocator (MALLOC_MMAP_THRESHOLD_ unset): time_s, cpu_time_s, cpu_pressure",
        "machine": machine_info(shape.device), "results": [],
    }
    results: list[dict[str, Any]] = document["results"]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    runs = "once (peak run only: smoke)" if smoke else "twice (peak run, then timing run)"
    print(f"{header(document)}; {len(rows)} configurations, each {runs} in a fresh process",
          file=sys.stderr, flush=True)
    with busy_neighbours(neighbours), _announce_partial(out, document):
        ours = [row for row in rows if row.peer == "longstraw"]
        # A smoke run shares one LongStraw worker (run_batch without isolation); otherwise each run is its own.
        shared = dict(zip((row.id for row in ours), run_longstraw(shape, ours, timeout_s, smoke=True)
                          if smoke and ours else []))
        for index, row in enumerate(rows, 1):
            peak = shared[row.id] if row.id in shared else run_configuration(
                shape, row, timeout_s, PEAK_THRESHOLD, smoke, trl_compact_head)
            timing = None if smoke or peak.get("status") != "ok" else run_configuration(
                shape, row, timeout_s, TIMING_THRESHOLD, smoke, trl_compact_head)
            entry = combine_runs(peak, timing)
            entry = {"id": row.id, "label": row.label, "peer": row.peer, "plan": row.plan, "batch": row.batch,
                     "accumulation": (shape.group_size // row.batch) if row.batch else None,
                     "checkpoint": row.checkpoint, "keep_prompt_graph": row.keep_prompt_graph,
                     "micro_batch": row.micro_batch if row.peer == "longstraw" else None,
                     **{k: v for k, v in entry.items() if k not in ("plan", "checkpoint")}}
            results.append(entry)
            print(f"[{index}/{len(rows)}] {row.label:<50} {_progress(entry)}", file=sys.stderr, flush=True)
            write_json(out + ".tmp", document)
    document["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    document["summary"] = {} if smoke else {**summarize(results), "flops_over_exact": flops_over_exact(shape, rows)}
    contended = [r for r in results if r.get("status") == "ok" and busy(r)]
    if neighbours and not smoke:
        document["notes"] = [f"{neighbours} busy-loop neighbour processes ran throughout (--neighbours): every time "
                             "is a busy host's, on purpose (peaks are not affected)"]
    elif contended and not smoke:
        document["notes"] = [f"{len(contended)} configurations ran while other processes competed for the CPU: "
                             "their times are inflated (peaks are not)"]
    written = write_results(out, document, "bench peers")
    if written is not None:
        os.remove(out + ".tmp")
    document[RESULTS_FILE] = written  # for the caller's last line; not in the file
    return document


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of `python -m benchmarks peers`: exit status 0 if at least one configuration ran."""
    check_out(args.out, args.fail)
    smoke = args.smoke or args.shape == "smoke"
    shape = SHAPES["smoke" if smoke else args.shape]
    if args.prompt_tokens:
        shape = replace(shape, prompt_tokens=args.prompt_tokens)
    rows = None
    if args.only:
        known = {c.id: c for c in configurations(shape.group_size)}
        unknown = [i for i in args.only if i not in known]
        if unknown:
            args.fail(f"--only: unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(known)}")
        rows = [known[i] for i in dict.fromkeys(args.only)]
    out = args.out or default_out("peers", smoke)
    document = run_peers_bench(shape, out, args.timeout, smoke, trl_compact_head=not args.trl_all_positions,
                               neighbours=args.neighbours, rows=rows)
    results: list[dict[str, Any]] = document["results"]
    if smoke:
        print(header(document))
        print("\n".join(f"{r['label']}: {r['status']}" for r in results))
        print(SMOKE_NOTE + "; no timing run (glibc's default allocator) in a smoke run")
    else:
        print(format_table(document))
    for note in document.get("notes", []):
        print(f"note: {note}")
    if document[RESULTS_FILE] is not None:
        print(f"results: {document[RESULTS_FILE]}")
    if not any(r.get("status") == "ok" for r in results):
        print(f"bench peers: every configuration failed; see stderr_tail in {out}.tmp", file=sys.stderr)
        return 1
    return 0


BENCHMARKS = (
    Benchmark(
        name="peers", help="LongStraw against TRL's GRPO step and Prefix Grouper on one shape: peak memory and time",
        description="LongStraw detach/exact, TRL (batch G and 1 x G, with and without checkpointing) and Prefix "
                    "Grouper (when installed), each in a fresh process on the same group; table and JSON.",
        add_arguments=add_arguments, run=run_from_args, table=format_table,
    ),
)
