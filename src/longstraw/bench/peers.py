"""`longstraw bench peers`: LongStraw against what users run today, on one shape, in one run (issue 12).

Configurations, each in a fresh process (peak = VmHWM above the loaded model, glibc's mmap threshold fixed, CPU
pressure recorded, as every bench: `bench/common.py`), on the same model weights and the same group (prompt, G
responses, advantages: `bench/worker.py`'s `make_group`):

* LongStraw `detach` and `exact`: `bench/worker.py`, one `backward_group` call.
* TRL's GRPO training step with per-device batch G (one micro-batch) and with batch 1 x G gradient-accumulation
  steps, each without and with activation checkpointing (TRL's default is with): a real `trl.GRPOTrainer`, only its
  generation replaced by the group, its LM head scoring only the completions as on CUDA (`--trl-all-positions`: as
  on CPU, every position; `bench/peers_worker.py` says exactly what runs).
* Prefix Grouper (PyPI `prefix-grouper`), without and with activation checkpointing: its own grouping and attention
  split through an SDPA adapter on CPU, LongStraw's log-prob head and grpo loss (`bench/peers_worker.py`). Optional:
  where it is not importable it is recorded as "not installed" (e.g. installed with `pip install --target DIR
  prefix-grouper` and found through `PYTHONPATH=DIR`).

Per configuration: status, peak MiB, time (one group's loss forward and backward, no optimizer step) and time over
`exact`'s. Then LongStraw against the strongest peer configuration: the one with the lowest peak, and the fastest.
A configuration that fails (error, out of memory, timeout) is recorded with its stderr tail and the run goes on.

`--shape b1` (default): b1-llama, fp32, CPU, P = 4096, R = 256, G = 8. `--smoke` (= `--shape smoke`): tiny-llama,
P = 64, R = 8, G = 4, seconds per configuration, only that every configuration runs (used by the tests).
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

from longstraw.bench.common import (
    B1,
    MIB,
    PEAK_RESOLUTION,
    SMOKE_NOTE,
    STDERR_TAIL,
    busy,
    default_out,
    describe_exit,
    peak_text,
    positive_float,
    run_batch,
    write_json,
)
from longstraw.bench.machine import machine_info
from longstraw.planner import positive_int

DEFAULT_TIMEOUT_S = 1800.0  # per configuration; TRL's unchecked batch of 8 at P = 4096 takes well under a minute


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


def configurations(g: int) -> list[Configuration]:
    """The table's rows for group size `g`, LongStraw first (`exact` is the time reference)."""
    rows = [Configuration("longstraw-detach", "LongStraw detach", "longstraw", plan="detach"),
            Configuration("longstraw-exact", "LongStraw exact", "longstraw", plan="exact")]
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


def _env(smoke: bool, mmap_threshold: int) -> dict[str, str]:
    env = dict(os.environ)
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)  # why: bench/common.py
    if smoke:
        env.setdefault("OMP_NUM_THREADS", "1")  # as run_batch: a smoke run only checks that everything runs
    return env


def run_peer(shape: PeersShape, row: Configuration, timeout_s: float | None, smoke: bool = False,
             mmap_threshold: int = B1.malloc_mmap_threshold, trl_compact_head: bool = True) -> dict[str, Any]:
    """Run a TRL or Prefix Grouper configuration in a fresh `bench/peers_worker.py`; its result (status "ok",
    "not installed" or "failed", with the error and stderr tail), never raising. trl_compact_head: TRL's LM head
    scores only the completions, as on CUDA (`peers_worker._compact_head_on_every_device`)."""
    payload = {"peer": row.peer, "model": shape.model, "dtype": shape.dtype, "device": shape.device,
               "prompt_tokens": shape.prompt_tokens, "response_tokens": shape.response_tokens,
               "group_size": shape.group_size, "seed": shape.seed, "batch": row.batch or shape.group_size,
               "checkpoint": row.checkpoint, "trl_compact_head": trl_compact_head}
    entry: dict[str, Any] = {}
    cmd = [sys.executable, "-m", "longstraw.bench.peers_worker", json.dumps(payload)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=_env(smoke, mmap_threshold))
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
                  smoke: bool = False) -> list[dict[str, Any]]:
    """LongStraw's rows through `bench/worker.py` (a fresh worker each; a smoke run shares one)."""
    config = replace(B1, model=shape.model, dtype=shape.dtype, device=shape.device, prompt_tokens=shape.prompt_tokens,
                     response_tokens=shape.response_tokens, chunk_size=shape.chunk_size, seed=shape.seed,
                     timeout_s=timeout_s)
    jobs = [(config, str(row.plan), shape.group_size) for row in rows]
    return run_batch(jobs, isolate=not smoke)


# ---------------------------------------------------------------- the table


def _ok(entry: dict[str, Any]) -> bool:
    return entry.get("status") == "ok" and float(entry.get("peak_bytes", 0)) >= PEAK_RESOLUTION


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    """time / exact per configuration, and LongStraw against the strongest peer configuration: the lowest peak
    (peer peak / ours: how many times less memory LongStraw uses) and the fastest (peer time / ours: > 1, LongStraw
    is faster). Empty parts where the needed configurations did not run."""
    by_id = {str(r["id"]): r for r in results}
    exact = by_id.get("longstraw-exact")
    summary: dict[str, Any] = {}
    if exact is not None and exact.get("status") == "ok":
        summary["time_over_exact"] = {str(r["id"]): float(r["time_s"]) / float(exact["time_s"])
                                      for r in results if r.get("status") == "ok"}
    ours = [r for r in results if r["peer"] == "longstraw" and _ok(r)]
    peers = [r for r in results if r["peer"] != "longstraw" and _ok(r)]
    if ours and peers:
        for what, key in (("memory", "peak_bytes"), ("time", "time_s")):
            best = min(peers, key=lambda r: float(r[key]))
            summary[f"strongest_peer_{what}"] = {
                "id": best["id"], "label": best["label"], key: best[key],
                "peer_over_longstraw": {str(r["plan"]): float(best[key]) / float(r[key])
                                        for r in ours},
            }
    return summary


def format_table(document: dict[str, Any]) -> str:
    results: list[dict[str, Any]] = document["results"]
    summary: dict[str, Any] = document["summary"]
    over: dict[str, float] = summary.get("time_over_exact", {})
    width = max(len(str(r["label"])) for r in results)
    lines = [f"{'configuration':<{width}}  {'status':<13} {'peak MiB':>9} {'time s':>9} {'time / exact':>12}"]
    for r in results:
        if r.get("status") == "ok":
            ratio = over.get(str(r["id"]))
            cells = (f"{peak_text(float(r['peak_bytes']))} {float(r['time_s']):9.2f} "
                     f"{'-' if ratio is None else f'{ratio:.2f}':>12}{'  (host busy)' if busy(r) else ''}")
        else:
            cells = f"{'-':>9} {'-':>9} {'-':>12}"
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
    parser.add_argument("--trl-all-positions", action="store_true",
                        help="TRL's LM head as TRL runs it on CPU: every position scored, prompt included (default: "
                             "only the completions, as TRL does on CUDA; bench/peers_worker.py)")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/peers-<time>.json; smoke: "
                                                    "under bench/results/smoke/)")


def run_peers_bench(shape: PeersShape, out: str, timeout_s: float | None, smoke: bool = False,
                    rows: list[Configuration] | None = None, trl_compact_head: bool = True) -> dict[str, Any]:
    """Run every configuration, write the JSON (after each configuration to `out`.tmp, at the end to `out`) and
    print progress on stderr; return the document."""
    rows = configurations(shape.group_size) if rows is None else rows
    document: dict[str, Any] = {
        "bench": "peers", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "shape": asdict(shape), "smoke": smoke,
        "timeout_s": timeout_s, "trl_compact_head": trl_compact_head, "machine": machine_info(shape.device),
        "results": [],
    }
    results: list[dict[str, Any]] = document["results"]
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    print(f"bench peers: {shape.model} {shape.dtype} {shape.device}, P={shape.prompt_tokens} R={shape.response_tokens} "
          f"G={shape.group_size}; {len(rows)} configurations, each in a fresh process", file=sys.stderr, flush=True)
    ours = [row for row in rows if row.peer == "longstraw"]
    measured = dict(zip((row.id for row in ours), run_longstraw(shape, ours, timeout_s, smoke) if ours else []))
    for index, row in enumerate(rows, 1):
        entry = (measured[row.id] if row.peer == "longstraw"
                 else run_peer(shape, row, timeout_s, smoke, trl_compact_head=trl_compact_head))
        entry = {"id": row.id, "label": row.label, "peer": row.peer, "plan": row.plan, "batch": row.batch,
                 "accumulation": (shape.group_size // row.batch) if row.batch else None,
                 "checkpoint": row.checkpoint, **{k: v for k, v in entry.items() if k not in ("mode", "checkpoint")}}
        results.append(entry)
        status = entry.get("status")
        if status == "ok":
            note = f"peak {peak_text(float(entry['peak_bytes']))} MiB  time {float(entry['time_s']):8.2f} s"
        else:
            note = f"{str(status).upper()}: {entry.get('error')}"
        print(f"[{index}/{len(rows)}] {row.label:<50} {note}", file=sys.stderr, flush=True)
        write_json(out + ".tmp", document)
    document["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    document["summary"] = {} if smoke else summarize(results)
    contended = [r for r in results if r.get("status") == "ok" and busy(r)]
    if contended and not smoke:
        document["notes"] = [f"{len(contended)} configurations ran while other processes competed for the CPU: "
                             "their times are inflated (peaks are not)"]
    write_json(out, document)
    os.remove(out + ".tmp")
    return document


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of `longstraw bench peers`: exit status 0 if at least one configuration ran."""
    smoke = args.smoke or args.shape == "smoke"
    shape = SHAPES["smoke" if smoke else args.shape]
    if args.prompt_tokens:
        shape = replace(shape, prompt_tokens=args.prompt_tokens)
    out = args.out or default_out("peers", smoke)
    document = run_peers_bench(shape, out, args.timeout, smoke, trl_compact_head=not args.trl_all_positions)
    results: list[dict[str, Any]] = document["results"]
    if smoke:
        print("\n".join(f"{r['label']}: {r['status']}" for r in results))
        print(SMOKE_NOTE)
    else:
        print(format_table(document))
    for note in document.get("notes", []):
        print(f"note: {note}")
    print(f"results: {out}")
    if not any(r.get("status") == "ok" for r in results):
        print("bench peers: every configuration failed; see stderr_tail in the result file", file=sys.stderr)
        return 1
    return 0
