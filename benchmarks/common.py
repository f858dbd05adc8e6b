"""What the benchmarks share: the job every bench runs (`MemoryBenchConfig`, Bench B1's defaults `B1`), running it in
a fresh worker process (`run_one`, `run_batch`), the result file (`default_out`, `write_json`; `write_results`,
every bench's final write: only with a finished row, never over an earlier file of more) and the sweeps' document,
progress lines and finish (`sweep_document`, `print_progress`, `finish_sweep`), the planner's forecast of
a measured peak (`predictor`), the B1-shaped presets per architecture family, and how a worker loads its model
(`load_bench_model`).

Workers run with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_, 128 KiB by default). With glibc's dynamic
threshold, freed blocks up to 32 MiB are kept in the heap and reused with fragmentation, so VmHWM measured the
allocator's history more than the plan: on b1-llama, detach at G=2 measured 244-559 MiB from run to run and less at
G=8 than at G=2 (bench/results/memory-b1-llama-4k-glibc-dynamic-mmap-20261129-0858.json). A fixed threshold returns
every large tensor to the OS on free, and the same configuration repeats within 1 MiB. The fixed threshold costs
time, though: every allocation above it is a fresh mmap, page-faulted on first touch, so a plan that allocates more
bytes per step pays more (b1-llama P=4096 G=8: `exact` allocates ~4.7 GB per step, Prefix Grouper 3.4 GB; in one
process exact took 4.9-5.4 s and Prefix Grouper 4.0-4.5 s with the fixed threshold, 3.8 s and 3.7-3.9 s with glibc's
default). `launch.worker_env` with threshold 0 removes the variable: glibc's default allocator, what users run
(`benchmarks peers` times its configurations so).

Nothing here imports another bench module (the worker runs as `python -m benchmarks.worker`), so every bench
module can import this one without a cycle; torch and transformers are imported where used (the planner, torch-free,
also at the top: its byte units MIB and GIB).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.launch import describe_exit, worker_command, worker_env
from benchmarks.machine import machine_info
from longstraw.choices import PLANS_BASELINE_FIRST, PRESET_NAMES
from longstraw.planner import GIB as GIB  # byte units, re-exported to the benches with MIB
from longstraw.planner import MIB
from longstraw.planner import non_negative_int as non_negative_int  # argparse type, re-exported to the benches

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

STDERR_TAIL = 4000  # characters of a failed worker's stderr kept in the result file
BUSY_PRESSURE = 0.1  # a step whose CPU pressure (PSI "some") exceeds this ran on a contended host
# A step peak below this is under what VmHWM can resolve once heap pages are reused (tiny models, or several
# configurations in one worker): shown as "< 1", and no ratio or growth is taken from it.
PEAK_RESOLUTION = MIB
SMOKE_NOTE = ("smoke run: it checks only that every configuration runs end to end; at this size peaks and times "
              "mean nothing, so no table of them, ratios or forecasts are printed (the JSON has the raw numbers)")
# A configuration is skipped when the planner predicts more than budget * (1 + this); the planner agrees with
# measured peaks within 15% (tests/planner/test_planner.py), so this never skips one that would have fitted.
PLANNER_SLACK = 0.15


@dataclass(frozen=True)
class MemoryBenchConfig:
    """One bench run. Defaults are Bench B1: b1-llama, fp32, P=4096, R=256, G in {2,4,8,16}, all 4 plans."""

    model: str = "b1-llama"
    dtype: str = "float32"
    device: str = "cpu"
    prompt_tokens: int = 4096
    response_tokens: int = 256
    # Multi-turn groups (an agent's): each response is `turns` turns of response_tokens generated tokens followed by
    # observation_tokens an environment appended (masked from the loss): turns * (R + O) tokens in all.
    turns: int = 1
    observation_tokens: int = 0
    groups: tuple[int, ...] = (2, 4, 8, 16)
    plans: tuple[str, ...] = PLANS_BASELINE_FIRST  # table/column order: the baseline first
    chunk_size: int = 2048
    micro_batch: int = 1
    seed: int = 0
    timeout_s: float | None = None  # per configuration; None waits as long as the worker runs
    malloc_mmap_threshold: int = 128 * 1024  # bytes, for the workers' glibc malloc; 0: glibc's default (unset)
    isolate: bool = True  # a fresh worker per configuration; False (--smoke): one worker runs them all
    checkpoints: tuple[str, ...] = ("none",)  # activation checkpointing: "none" and/or "layers", side by side
    offload_state: bool = False  # detach/exact: prompt state in host memory (backward_group(offload_state=True))
    keep_prompt_graph: int = 0  # exact: capture chunks whose graph is kept (backward_group(keep_prompt_graph=N))
    max_positions: int = 0  # > 0: override the model's max_position_embeddings (a measurement past its context)
    warm_steps: int = 0  # steps after the measured cold one; > 0: the fastest is the time (the peak: the cold one)
    smoke: bool = False  # --smoke: report only that every configuration ran


B1 = MemoryBenchConfig()
# Architecture families with a Bench B1 preset `b1-<arch>` (`bench arch --archs`, `bench memory --arch`), read from the
# preset names, which import no torch (for --help).
B1_ARCHS = tuple(sorted(name[len("b1-"):] for name in PRESET_NAMES if name.startswith("b1-")))


def job_config(cfg, model: str, prompt_tokens: int, chunk_size: int, micro_batch: int) -> MemoryBenchConfig:
    """A sweep's worker job: B1 with the model and shape given and the sweep config `cfg`'s dtype, device, R, seed,
    timeout, malloc threshold and isolation."""
    return replace(
        B1, model=model, dtype=cfg.dtype, device=cfg.device, prompt_tokens=prompt_tokens,
        response_tokens=cfg.response_tokens, chunk_size=chunk_size, micro_batch=micro_batch, seed=cfg.seed,
        timeout_s=cfg.timeout_s, malloc_mmap_threshold=cfg.malloc_mmap_threshold, isolate=cfg.isolate,
    )


# ---------------------------------------------------------------- result files and text


def default_out(bench: str, smoke: bool) -> str:
    """bench/results/<bench>-<time>.json; a smoke run's under bench/results/smoke/ (ignored by git: its numbers
    are not results)."""
    folder = os.path.join("bench", "results", "smoke") if smoke else os.path.join("bench", "results")
    return os.path.join(folder, f"{bench}-{time.strftime('%Y%m%d-%H%M%S')}.json")


def write_json(path: str, document: dict[str, Any]) -> None:
    """Write `document` to `path` whole or not at all: a signal mid-write (SIGTERM, Ctrl-C) leaves the previous
    file, never a cut-short one (the peers bench announces its `.tmp` file as holding the finished results)."""
    part = f"{path}.part"
    try:
        with open(part, "w") as f:
            json.dump(document, f, indent=2)
            f.write("\n")
        os.replace(part, path)
    finally:
        if os.path.exists(part):
            os.remove(part)


# The key under which `run_*_bench` functions return the path `write_results` wrote (None: nothing); never written.
RESULTS_FILE = "results_file"


def finished_rows(document: Any) -> int | None:
    """How many of a results document's rows finished: `results` entries with status "ok" (measured) or "skipped"
    (the planner's verdict that it cannot fit, an answer too); a document of one `result` counts 1. None for
    something that is not a LongStraw results document."""
    if not isinstance(document, dict):
        return None
    if isinstance(document.get("results"), list):
        return sum(1 for r in document["results"] if isinstance(r, dict) and r.get("status") in ("ok", "skipped"))
    if isinstance(document.get("result"), dict):
        return 1
    return None


def write_results(out: str, document: dict[str, Any], what: str) -> str | None:
    """Every bench's results file: write `document` to `out` (atomically, `write_json`) only if at least one of its
    rows finished, and never over an earlier file holding more finished rows (or one that is not a results
    document): then to a new name beside it, saying so on stderr. Returns the path written, or None (nothing
    finished: nothing written, one line on stderr). `what` names the bench in those lines."""
    rows = finished_rows(document)
    if not rows:
        partial = f"; the failed rows are in {out}.tmp" if os.path.exists(out + ".tmp") else ""
        print(f"{what}: no row finished, so no results file is written ({out} is left as it was{partial})",
              file=sys.stderr)
        return None
    path = out
    if os.path.exists(out):
        try:
            with open(out) as f:
                earlier = finished_rows(json.load(f))
        except (OSError, ValueError):
            earlier = None
        if earlier is None or earlier > rows:
            stem, ext = os.path.splitext(out)
            path = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}{ext or '.json'}"
            n = 1
            while os.path.exists(path):
                n += 1
                path = f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{n}{ext or '.json'}"
            held = "is not a results file" if earlier is None else f"holds {earlier} finished rows"
            print(f"{what}: {out} {held} and this run finished {rows}: it is kept, and the results go to {path}",
                  file=sys.stderr)
    write_json(path, document)
    return path


def finish_run(document: dict[str, Any], table: Callable[[dict[str, Any]], str], out: str, what: str) -> int:
    """A run's end: stamp `finished`, print the table, write the results file (`write_results`, its folder made);
    the exit status, 1 when nothing was written."""
    document["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    print(table(document))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    return 0 if write_results(out, document, what) is not None else 1


def mib_text(value: float | None, width: int = 9) -> str:
    """A size in MiB for a table cell, or "-" where there is none."""
    return f"{'-':>{width}}" if value is None else f"{value / MIB:{width}.1f}"


def peak_text(peak_bytes: float, width: int = 9) -> str:
    """A step peak in MiB, or "< 1" under the measurement's resolution (never a negative size)."""
    if peak_bytes < PEAK_RESOLUTION:
        return f"{'< 1':>{width}}"
    return f"{peak_bytes / MIB:{width}.1f}"


def smoke_summary(results: list[dict[str, Any]], what: str) -> str:
    """One line for a smoke run: how many configurations ran, which failed."""
    failed = [r for r in results if r.get("status") not in ("ok", "skipped")]
    lines = [f"{what}: {len(results) - len(failed)} of {len(results)} configurations ran", SMOKE_NOTE]
    lines += [f"  FAILED: {r.get('plan')} G={r.get('group_size')}: {r.get('error')}" for r in failed]
    return "\n".join(lines)


def busy(entry: dict[str, Any]) -> bool:
    """Whether a measured step ran while other processes competed for the CPU (its time is inflated)."""
    pressure = entry.get("cpu_pressure")
    return isinstance(pressure, float) and pressure > BUSY_PRESSURE


def check_device(device: str, fail: Callable[[str], Any]) -> None:
    """The benches' --device rule (cpu or cuda[:i], a GPU this machine has); `fail` reports a bad value (argparse's
    error, which exits)."""
    if device != "cpu" and not device.startswith("cuda"):
        fail(f"--device must be cpu or cuda[:i], got {device!r}")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            fail(f"--device {device}: this machine has no CUDA GPU (or torch was built without CUDA); use --device cpu")
        index = torch.device(device).index
        if index is not None and index >= torch.cuda.device_count():
            fail(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def check_out(out: str | None, fail: Callable[[str], Any]) -> None:
    """The benches' --out rule: a file path (not a directory) whose folder exists or can be made."""
    if out is None:
        return
    path = Path(out)
    if path.is_dir():
        fail(f"--out {out} is a directory: give the results file's path, e.g. {path / 'results.json'}")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        fail(f"--out {out}: {parent} is not a writable directory")


def check_model(name: str, fail: Callable[[str], Any]) -> None:
    """The benches' --model rule: a preset, packaged model, local directory or file, or a hub id, checked before
    any work (`admission.loading.check_model_name`)."""
    from longstraw.admission.loading import check_model_name

    try:
        check_model_name(name)
    except ValueError as err:
        fail(f"--model: {err}")


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (the benches' --timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


# ---------------------------------------------------------------- running a configuration in a fresh worker


# A job: (config, plan, G) or (config, plan, G, checkpoint); checkpoint "none" when left out.
Job = tuple[MemoryBenchConfig, str, int] | tuple[MemoryBenchConfig, str, int, str]


def _unpack(job: Job) -> tuple[MemoryBenchConfig, str, int, str]:
    config, plan, g, *rest = job
    return config, plan, g, (str(rest[0]) if rest else "none")


def worker_config(config: MemoryBenchConfig, plan: str, group_size: int,
                  checkpoint: str = "none") -> dict[str, Any]:
    """The JSON object `benchmarks/worker.py` reads (every key of its `CONFIG_KEYS`)."""
    return {
        "model": config.model, "dtype": config.dtype, "device": config.device,
        "prompt_tokens": config.prompt_tokens, "response_tokens": config.response_tokens,
        "group_size": group_size, "plan": plan, "chunk_size": config.chunk_size,
        "micro_batch": config.micro_batch, "seed": config.seed, "checkpoint": checkpoint,
        "offload_state": config.offload_state, "max_positions": config.max_positions,
        "keep_prompt_graph": config.keep_prompt_graph if plan == "exact" else 0,
        "turns": config.turns, "observation_tokens": config.observation_tokens, "warm_steps": config.warm_steps,
    }


# `bench peers` and `bench tree` run each configuration twice, each time in a fresh process: a peak run (the fixed
# threshold above: peaks that repeat) and a timing run under glibc's default allocator, what users run.
TIMING_THRESHOLD = 0  # the timing run's: glibc's default allocator (MALLOC_MMAP_THRESHOLD_ unset)
# What the timing run contributes to a configuration's entry (the rest is the peak run's), and what else of it
# the entry keeps under "timing_run".
TIMING_KEYS = ("time_s", "cpu_time_s", "cpu_pressure")
TIMING_RUN_KEYS = ("status", "error", *TIMING_KEYS, "peak_bytes", "malloc_mmap_threshold", "process_s", "stats",
                   "stderr_tail")


def combine_runs(peak: dict[str, Any], timing: dict[str, Any] | None) -> dict[str, Any]:
    """A configuration's entry: its peak run's result (fixed mmap threshold) with the time, CPU time and CPU pressure
    of its timing run (glibc's default allocator); the peak run's as `time_fixed_threshold_s`,
    `cpu_time_fixed_threshold_s`, `cpu_pressure_fixed_threshold`; the timing run's status and the rest of its
    measurement under `timing_run`. A failed timing run leaves the three None (no time, the peak stands); timing
    None (not run: the peak run did not succeed, or a smoke run) keeps the peak run's result as it is."""
    entry = dict(peak)
    if timing is None or peak.get("status") != "ok":
        return entry
    entry.update(time_fixed_threshold_s=peak.get("time_s"), cpu_time_fixed_threshold_s=peak.get("cpu_time_s"),
                 cpu_pressure_fixed_threshold=peak.get("cpu_pressure"))
    ok = timing.get("status") == "ok"
    entry.update({key: timing.get(key) if ok else None for key in TIMING_KEYS})
    entry["timing_run"] = {key: timing[key] for key in TIMING_RUN_KEYS if key in timing}
    return entry


def run_one(config: MemoryBenchConfig, plan: str, group_size: int, checkpoint: str = "none") -> dict[str, Any]:
    """Run one configuration in a fresh worker; return its result (status ok or failed), never raise."""
    entry: dict[str, Any] = {"plan": plan, "group_size": group_size, "checkpoint": checkpoint}
    payload = json.dumps(worker_config(config, plan, group_size, checkpoint))
    cmd = worker_command("worker", payload)
    env = worker_env(config.malloc_mmap_threshold)  # see the module docstring
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=config.timeout_s, env=env)
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
        entry.update(status="failed", error=f"timed out after {config.timeout_s} s",
                     stderr_tail=stderr[-STDERR_TAIL:], process_s=time.perf_counter() - t0)
        return entry
    entry["process_s"] = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        error = describe_exit(proc.returncode) if proc.returncode != 0 else "worker printed no result"
        entry.update(status="failed", error=error, stderr_tail=proc.stderr[-STDERR_TAIL:])
        return entry
    try:
        measurement = json.loads(lines[-1])
    except json.JSONDecodeError as err:
        entry.update(status="failed", error=f"unreadable worker output: {err}",
                     stderr_tail=proc.stderr[-STDERR_TAIL:])
        return entry
    entry.update(status="ok", **measurement)
    return entry


def run_batch(jobs: Sequence[Job], isolate: bool = True) -> list[dict[str, Any]]:
    """Run (config, plan, G[, checkpoint]) jobs; isolate: a fresh worker each (the benchmarks), else one worker
    for all, restarted after a failure (`--smoke`: saves a process start per configuration). Never raises."""
    unpacked = [_unpack(job) for job in jobs]
    if isolate or len(jobs) <= 1:
        return [run_one(config, plan, g, ckpt) for config, plan, g, ckpt in unpacked]
    results: list[dict[str, Any]] = []
    while len(results) < len(unpacked):
        rest = unpacked[len(results):]
        config = rest[0][0]
        payload = json.dumps([worker_config(c, m, g, ck) for c, m, g, ck in rest])
        env = worker_env(config.malloc_mmap_threshold, smoke=True)  # one worker for all: smoke runs
        t0 = time.perf_counter()
        proc = subprocess.run(worker_command("worker", payload), capture_output=True, text=True, env=env)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        share = (time.perf_counter() - t0) / max(1, len(lines) + (proc.returncode != 0))
        for (_, plan, g, ckpt), line in zip(rest, lines):
            results.append({"plan": plan, "group_size": g, "checkpoint": ckpt, "status": "ok", "process_s": share,
                            **json.loads(line)})
        if len(results) < len(unpacked):
            _, plan, g, ckpt = unpacked[len(results)]
            error = describe_exit(proc.returncode) if proc.returncode != 0 else "worker printed no result"
            results.append({"plan": plan, "group_size": g, "checkpoint": ckpt, "status": "failed", "error": error,
                            "stderr_tail": proc.stderr[-STDERR_TAIL:], "process_s": share})
    return results


def load_bench_model(name: str, dtype: str, device: str = "cpu"):
    """A worker's model: `models.load_model` with seed 0; on CUDA a preset is built directly on the GPU in its dtype
    (`init_on_device`): a 1B-parameter preset initialised in fp32 on the CPU first would cost each GPU worker ~10 s
    and 5 GB of host memory."""
    import torch

    from longstraw.admission.loading import load_model

    model = load_model(name, dtype=dtype, device=device, seed=0, init_on_device=torch.device(device).type == "cuda")
    # Weights loaded from safetensors can stay memory-mapped: their pages become resident only when the step first
    # reads them, so they would count in the step's peak (VmHWM) and not in the baseline taken before it. Reading
    # every weight once makes them resident first (bench/results/memory-smollm2-135m-32k-exact-ckpt-20261130.json was
    # recorded without this read: its baseline RSS, 378 MB, is below the 538 MB of fp32 weights alone).
    with torch.no_grad():
        for p in model.parameters():
            p.sum()
    return model


# ---------------------------------------------------------------- the sweeps' documents


def sweep_document(bench: str, config: DataclassInstance, device: str) -> dict[str, Any]:
    """A sweep's result document before its first configuration: bench, start time, config, machine, results."""
    return {"bench": bench, "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "config": asdict(config),
            "machine": machine_info(device), "results": []}


def print_progress(index: int, entry: dict[str, Any], label: str) -> None:
    """A sweep's progress line on stderr for one configuration (ok, skipped or FAILED)."""
    head = f"[{index}] {label:<28} {entry['plan']:<17}"
    if entry["status"] == "ok":
        note = f"  (host busy: CPU pressure {entry['cpu_pressure']:.0%})" if busy(entry) else ""
        line = f"{head} peak {peak_text(float(entry['peak_bytes']))} MiB  step {entry['time_s']:8.2f} s{note}"
    elif entry["status"] == "skipped":
        line = f"{head} skipped: {entry['error']}"
    else:
        line = f"{head} FAILED: {entry['error']}"
    print(line, file=sys.stderr, flush=True)


def finish_sweep(document: dict[str, Any], out: str, table: str, plot: Callable[[dict, str], str | None],
                 smoke: bool = False) -> None:
    """Write the JSON and the plot, print the table (a smoke run: only whether every configuration ran)."""
    document["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    if smoke:
        table = smoke_summary(document["results"], f"bench {document['bench']}")
    contended = [r for r in document["results"] if r.get("status") == "ok" and busy(r)]
    if contended and not smoke:
        document.setdefault("notes", []).append(
            f"{len(contended)} configurations ran while other processes competed for the CPU: their times are "
            "inflated (peaks are not); compare times as ratios within this run")
    written = write_results(out, document, f"bench {document['bench']}")
    if written is None:
        return
    if os.path.exists(out + ".tmp"):
        os.remove(out + ".tmp")
    png = plot(document, os.path.splitext(written)[0] + ".png")
    print(table)
    for note in document.get("notes", []):
        print(f"note: {note}")
    print(f"results: {written}" + (f", plot: {png}" if png else ""))


# ---------------------------------------------------------------- the planner's forecast


def predictor(model: str, dtype: str, device: str = "cpu", quiet: bool = False):
    """The planner's step-memory forecast `predict(P, R, G, plan, chunk, micro_batch, checkpoint_layers=False,
    offload_state=False, keep_prompt_graph=0)` in bytes, what a worker measures (the peak above the loaded model, no
    optimizer): on CPU with the planner's CPU runtime allowance, on CUDA without a reserve (`max_memory_allocated`
    counts none).

    None if the planner cannot read the model or the dtype: the bench then runs without skipping (quiet: no note)."""
    from longstraw import planner

    on_cpu = not device.startswith("cuda")
    try:
        spec = planner.spec_from_config(planner.load_config(model), model)
        if dtype not in planner.DTYPE_BYTES:
            raise ValueError(f"unknown dtype {dtype!r}")
    except Exception as err:  # a bench must not die on a model the planner does not know
        if not quiet:
            print(f"note: no planner prediction for {model} ({err}); nothing will be skipped", file=sys.stderr)
        return None

    def predict(p: int, r: int, g: int, plan: str, chunk: int, k: int, checkpoint_layers: bool = False,
                offload_state: bool = False, keep_prompt_graph: int = 0) -> int:
        inp = planner.PlanInputs(prompt_tokens=p, response_tokens=r, group_size=g, dtype=dtype, chunk_size=chunk,
                                 micro_batch=k, device="cpu" if on_cpu else "cuda", reserve=None if on_cpu else 0,
                                 optimizer="none", checkpoint_layers=checkpoint_layers, offload_state=offload_state,
                                 keep_prompt_graph=keep_prompt_graph if plan == "exact" else 0)
        return planner.estimate(spec, inp, plan).step_bytes

    return predict


# ---------------------------------------------------------------- presets per architecture family


def available_archs() -> list[str]:
    """Architecture families with a B1-shaped preset `b1-<arch>` in `longstraw.models.presets.PRESETS`."""
    from longstraw.models.presets import PRESETS

    return sorted(name[len("b1-"):] for name in PRESETS if name.startswith("b1-"))


def arch_preset(arch: str) -> str:
    """The preset name of an architecture family (`llama` -> `b1-llama`); ValueError listing those that exist."""
    from longstraw.choices import did_you_mean
    from longstraw.models.presets import PRESETS

    name = f"b1-{arch}"
    if name not in PRESETS:
        raise ValueError(f"no preset {name!r}{did_you_mean(arch, available_archs())}: architectures with a B1 "
                         f"preset: {', '.join(available_archs())}")
    return name


def smoke_preset(arch: str) -> str:
    """The smallest preset of a family for `--smoke`: `tiny-<arch>` if it exists, else `b1-<arch>`."""
    from longstraw.models.presets import PRESETS

    return f"tiny-{arch}" if f"tiny-{arch}" in PRESETS else arch_preset(arch)
