"""What `bench/gpu.sh` runs: the gpu tests, Bench B1's comparison at a ~1B model, the longest prompt of one exact
step, and sampling throughput, in one call with a wall-clock deadline (8 minutes on one H200),
every configuration in a fresh worker. Parts in order of priority; nothing starts after the deadline:

  0. the gpu-marked tests (`pytest -m gpu tests/gpu`: fused CUDA attention vs portable vs naive in bf16/fp16/fp32,
     exact == standard in bf16 on llama, qwen3, qwen3_next, sampled log-probs == a full forward);
  1. B1 comparison on `gpu-llama-1b` (1.26B parameters, random init, bf16): P in {32768, 131072}, R = 512,
     G in {2, 8}, all four plans, peak = `torch.cuda.max_memory_allocated` after a reset, and the ratios;
  2. the longest prompt of one exact step (G = 2): doubling from 262144 while steps succeed and time remains (the
     B1 part's exact step at 131072 is the floor of the record);
  3. sampling throughput against transformers' `generate` (`python -m benchmarks decode`, P in {32768, 131072}, G = 8);
  4. (`--pareto`) the micro-batch x chunk Pareto sweep at P = 65536, G = 8, detach and exact.
A configuration the planner predicts above the GPU's memory by more than 15% is skipped (recorded, not run);
one predicted near the limit runs and may fail with an OOM, which is recorded. Each result carries the planner's
prediction beside the measured peak, so a GPU run also checks the planner.

`--device cpu --smoke` is the dry run: tiny-llama, fp32, seconds (the gpu tests are then skipped: no CUDA); the test
suite runs it. Output directory: `--out-dir`, else `$OUT`, else bench/results/gpu-<timestamp>: gpu-tests.json,
memory-P<P>.json, longest-exact.json, decode.json, pareto.json, summary.json, summary.md (the Markdown tables) and
PNGs. Not run on a GPU yet.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks.common import (
    B1,
    GIB,
    MIB,
    PEAK_RESOLUTION,
    PLANNER_SLACK,
    STDERR_TAIL,
    MemoryBenchConfig,
    check_device,
    predictor,
    run_batch,
    run_one,
    write_json,
)
from benchmarks.launch import importable
from benchmarks.machine import machine_info
from benchmarks.memory import compute_ratios
from benchmarks.registry import Benchmark
from longstraw.choices import PLANS_BASELINE_FIRST


@dataclass(frozen=True)
class GpuBenchConfig:
    model: str = "gpu-llama-1b"
    dtype: str = "bfloat16"
    device: str = "cuda"
    run_tests: bool = True  # part 0: pytest -m gpu tests/gpu
    tests_timeout_s: float = 120.0
    prompts: tuple[int, ...] = (32768, 131072)
    response_tokens: int = 512
    groups: tuple[int, ...] = (2, 8)
    plans: tuple[str, ...] = PLANS_BASELINE_FIRST
    chunk_size: int = 8192
    longest_from: int = 262144  # part 2: the first P of the doubling (0: skip the part)
    longest_to: int = 2**21
    longest_group: int = 2
    decode_prompts: tuple[int, ...] = (32768, 131072)  # part 3 (empty: skip the part)
    decode_group: int = 8
    decode_tokens: int = 32
    pareto: bool = False  # part 4
    pareto_prompt: int = 65536
    pareto_group: int = 8
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    chunk_sizes: tuple[int, ...] = (8192, 32768)
    deadline_s: float = 450.0  # stop starting configurations after this (the call's limit is 8 min)
    config_timeout_s: float = 150.0
    reserve_bytes: int = GIB  # CUDA context etc., for the planner's skip decision
    isolate: bool = True  # a fresh worker per configuration; False (smoke): one worker per part
    plots: bool = True  # PNGs beside the JSON (--no-plots: the device tool returns at most 8 files)


SMOKE = replace(GpuBenchConfig(), model="tiny-llama", dtype="float32", device="cpu", run_tests=False, prompts=(64,),
                response_tokens=8, groups=(2,), chunk_size=32, longest_from=128, longest_to=256, decode_prompts=(64,),
                decode_group=2, decode_tokens=4, pareto=True, pareto_prompt=64, pareto_group=4, micro_batches=(1, 2),
                chunk_sizes=(32,), deadline_s=120.0, config_timeout_s=60.0, isolate=False)


def _device_memory(device: str) -> int | None:
    """Total memory of the CUDA device (None on CPU or when CUDA is unavailable)."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.device(device).index or 0).total_memory


def _run_gpu_tests(cfg: GpuBenchConfig, out_dir: str, timeout_s: float) -> dict[str, Any]:
    """Part 0: `pytest -m gpu tests/gpu` in a subprocess; its counts and output tail into gpu-tests.json."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", os.path.join(root, "tests", "gpu")]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=root)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        output = (err.stdout.decode(errors="replace") if isinstance(err.stdout, bytes) else err.stdout or "")
        rc = None
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", output)}
    doc = {"bench": "gpu-tests", "command": " ".join(cmd), "returncode": rc, "counts": counts,
           "wall_s": time.perf_counter() - t0, "status": "ok" if rc == 0 else ("timeout" if rc is None else "failed"),
           "output_tail": output[-STDERR_TAIL:]}
    write_json(os.path.join(out_dir, "gpu-tests.json"), doc)
    print(f"gpu tests: {doc['status']} {counts} in {doc['wall_s']:.0f} s", file=sys.stderr, flush=True)
    return doc


def _record(entry: dict[str, Any], job: MemoryBenchConfig, label: str, summary: dict[str, Any]) -> None:
    """Complete a finished configuration's entry (its forecast over its peak), print its line after `label`, and add
    its check to the summary."""
    entry["micro_batch"], entry["chunk_size"] = job.micro_batch, job.chunk_size
    predicted = entry["predicted_step_bytes"]
    if entry.get("status") == "ok":
        forecast = "(no planner forecast)"
        if isinstance(predicted, int):
            entry["predicted_over_measured"] = predicted / max(1, int(entry["peak_bytes"]))
            forecast = f"(planner {predicted / MIB:9.1f})"
        note = f"peak {entry['peak_bytes'] / MIB:9.1f} MiB {forecast}  {entry['time_s']:7.2f} s"
    else:
        note = f"{entry['status']}: {entry.get('error')}"
    print(f"{label} {note}", file=sys.stderr, flush=True)
    summary["checks"].append({k: entry.get(k) for k in (
        "plan", "group_size", "prompt_tokens", "micro_batch", "chunk_size", "status", "peak_bytes",
        "predicted_step_bytes", "time_s")})


def _b1_at(cfg: GpuBenchConfig, job: MemoryBenchConfig, run: Callable[[list[Any]], list[dict[str, Any]]],
           out_dir: str, summary: dict[str, Any]) -> None:
    """Part 1 at one prompt length: B1 (every plan and G) through `run`; its document memory-P<P>.json (+ PNG)."""
    from benchmarks.plots import plot_memory

    p = job.prompt_tokens
    results = run([(job, plan, g, f"B1 P={p} G={g}") for g in cfg.groups for plan in cfg.plans])
    doc = {"bench": "memory", "started": summary["started"], "config": asdict(job), "machine": summary["machine"],
           "results": results, "ratios": compute_ratios(results)}
    summary.setdefault("b1", {})[str(p)] = {"results": results, "ratios": doc["ratios"]}
    path = os.path.join(out_dir, f"memory-P{p}.json")
    write_json(path, doc)
    if cfg.plots:
        plot_memory(doc, os.path.splitext(path)[0] + ".png")
    summary["documents"].append(path)


def run_gpu_bench(cfg: GpuBenchConfig, out_dir: str) -> dict[str, Any]:
    """Run the parts in order (module docstring) until the deadline; write every document into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()
    machine = machine_info(cfg.device)
    memory = _device_memory(cfg.device)
    predict = predictor(cfg.model, cfg.dtype, cfg.device)
    summary: dict[str, Any] = {"config": asdict(cfg), "machine": machine, "device_memory_bytes": memory,
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "documents": [], "checks": []}

    def left() -> float:
        return cfg.deadline_s - (time.perf_counter() - t_start)

    if cfg.run_tests:
        summary["tests"] = _run_gpu_tests(cfg, out_dir, min(cfg.tests_timeout_s, max(10.0, left())))
        summary["documents"].append(os.path.join(out_dir, "gpu-tests.json"))

    def run(jobs: list[tuple[MemoryBenchConfig, str, int, str]]) -> list[dict[str, Any]]:
        """Decide skips (planner, deadline), run the rest (one worker each, or one for all in smoke runs)."""
        entries: list[dict[str, Any]] = []
        for job, plan, g, _ in jobs:
            predicted = predict(job.prompt_tokens, cfg.response_tokens, g, plan, job.chunk_size,
                                job.micro_batch) if predict else None
            entry: dict[str, Any] = {"plan": plan, "group_size": g, "prompt_tokens": job.prompt_tokens,
                                     "chunk_size": job.chunk_size, "micro_batch": job.micro_batch,
                                     "predicted_step_bytes": predicted}
            if (memory is not None and predicted is not None
                    and predicted > (memory - cfg.reserve_bytes) * (1 + PLANNER_SLACK)):
                entry.update(status="skipped", error=f"planner predicts {predicted / MIB:.0f} MiB > device memory")
            entries.append(entry)
        todo = [(i, jobs[i]) for i, e in enumerate(entries) if "status" not in e]
        if cfg.isolate:
            for i, (job, plan, g, _) in todo:
                remaining = left()
                if remaining < 10:
                    entries[i].update(status="skipped", error="deadline reached")
                    continue
                entries[i].update(run_one(replace(job, timeout_s=min(cfg.config_timeout_s, remaining)), plan, g))
        else:
            measured = run_batch([(job, plan, g) for _, (job, plan, g, _) in todo], isolate=False)
            for (i, _), m in zip(todo, measured):
                entries[i].update(m)
        for entry, (job, plan, _, label) in zip(entries, jobs):
            _record(entry, job, f"[{time.perf_counter() - t_start:5.0f} s] {label:<24} {plan:<17}", summary)
        return entries

    base = replace(B1, model=cfg.model, dtype=cfg.dtype, device=cfg.device, response_tokens=cfg.response_tokens,
                   chunk_size=cfg.chunk_size, groups=cfg.groups, plans=cfg.plans)
    for p in cfg.prompts:
        _b1_at(cfg, replace(base, prompt_tokens=p), run, out_dir, summary)

    if cfg.longest_from:
        summary["longest_exact"] = _longest_exact(cfg, base, run, out_dir, summary)
    if cfg.decode_prompts:
        summary["decode"] = _decode(cfg, out_dir, left)
        if os.path.exists(os.path.join(out_dir, "decode.json")):
            summary["documents"].append(os.path.join(out_dir, "decode.json"))
    if cfg.pareto:
        _pareto(cfg, base, run, out_dir, summary)
    summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    summary["wall_s"] = time.perf_counter() - t_start
    write_json(os.path.join(out_dir, "summary.json"), summary)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(markdown(summary))
    checks = summary["checks"]
    n_ok = sum(1 for c in checks if c["status"] == "ok")
    print(f"gpu bench: {n_ok}/{len(checks)} configurations ok in {summary['wall_s']:.0f} s; results in {out_dir}")
    return summary


def _pareto(cfg: GpuBenchConfig, base: MemoryBenchConfig, run, out_dir: str, summary: dict[str, Any]) -> None:
    """Part 4: micro-batch x chunk at one (P, G) for detach and exact, with the Pareto front flagged."""
    from benchmarks.plots import plot_pareto

    pareto_job = replace(base, prompt_tokens=cfg.pareto_prompt)
    results = run([(replace(pareto_job, micro_batch=k, chunk_size=c), plan, cfg.pareto_group,
                    f"pareto k={k} chunk={c}")
                   for plan in ("detach", "exact") for k in cfg.micro_batches for c in cfg.chunk_sizes])
    from benchmarks.pareto import pareto_flags

    for plan in ("detach", "exact"):
        ok = [r for r in results if r["plan"] == plan and r.get("status") == "ok"]
        for r, flag in zip(ok, pareto_flags([(r["peak_bytes"], r["time_s"]) for r in ok])):
            r["pareto"] = flag
    pareto_cfg = {"model": cfg.model, "prompt_tokens": cfg.pareto_prompt, "response_tokens": cfg.response_tokens,
                  "group_size": cfg.pareto_group, "micro_batches": list(cfg.micro_batches),
                  "chunk_sizes": list(cfg.chunk_sizes), "dtype": cfg.dtype, "device": cfg.device}
    doc = {"bench": "pareto", "started": summary["started"], "config": pareto_cfg, "machine": summary["machine"],
           "results": results}
    path = os.path.join(out_dir, "pareto.json")
    write_json(path, doc)
    if cfg.plots:
        plot_pareto(doc, os.path.splitext(path)[0] + ".png")
    summary["documents"].append(path)


def _decode(cfg: GpuBenchConfig, out_dir: str, left) -> dict[str, Any]:
    """Part 3: `python -m benchmarks decode` on the bench's model in a fresh process (an OOM of transformers' G-times
    cache at the longest P must not end the run), within the time left; its table for summary.md."""
    path = os.path.join(out_dir, "decode.json")
    cmd = [sys.executable, "-m", "benchmarks", "decode", "--model", cfg.model, "--dtype", cfg.dtype,
           "--device", cfg.device, "--prompts", *map(str, cfg.decode_prompts), "--group-size", str(cfg.decode_group),
           "--new-tokens", str(cfg.decode_tokens), "--chunk-size", str(cfg.chunk_size), "--out", path]
    entry: dict[str, Any] = {"command": " ".join(cmd)}
    if left() < 10:
        entry.update(status="skipped", error="deadline reached")
        return entry
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left(), env=importable(dict(os.environ)))
        entry.update(status="ok" if proc.returncode == 0 else "failed", returncode=proc.returncode,
                     table=proc.stdout.strip(), stderr_tail=proc.stderr[-STDERR_TAIL:])
    except subprocess.TimeoutExpired:
        entry.update(status="failed", error="deadline reached while running")
    entry["wall_s"] = time.perf_counter() - t0
    print(f"[decode] {entry['status']} in {entry['wall_s']:.0f} s", file=sys.stderr, flush=True)
    return entry


def _longest_exact(cfg: GpuBenchConfig, base: MemoryBenchConfig, run, out_dir: str,
                   summary: dict[str, Any]) -> dict[str, Any]:
    """Part 2: one exact step (G = longest_group) at P = longest_from, doubling while steps succeed; the B1 part's
    exact steps count too. Returns the record (the longest P that succeeded) and every attempt."""
    attempts: list[dict[str, Any]] = []
    p = cfg.longest_from
    while p <= cfg.longest_to:
        job = replace(base, prompt_tokens=p, max_positions=p + cfg.response_tokens + 1)
        (entry,) = run([(job, "exact", cfg.longest_group, f"longest exact P={p}")])
        attempts.append(entry)
        if entry.get("status") != "ok":
            break
        p *= 2
    ok = [c for c in summary["checks"] if c["plan"] == "exact" and c["status"] == "ok"]
    record = max(ok, key=lambda c: c["prompt_tokens"]) if ok else None
    doc = {"bench": "longest-exact", "config": {"model": cfg.model, "dtype": cfg.dtype, "device": cfg.device,
                                                "response_tokens": cfg.response_tokens, "group_size": cfg.longest_group,
                                                "chunk_size": cfg.chunk_size},
           "attempts": attempts, "record": record}
    path = os.path.join(out_dir, "longest-exact.json")
    write_json(path, doc)
    summary["documents"].append(path)
    return {"record": record, "attempted": [(a["prompt_tokens"], a.get("status")) for a in attempts]}


# The GPU targets at G = 8 (ratios from compute_ratios): (key, threshold, at least?, text).
TARGETS = (
    ("peak_standard_batched_over_detach", 8.0, True, "detach >= 8x less peak than standard_batched"),
    ("peak_standard_batched_over_exact", 6.0, True, "exact >= 6x less peak than standard_batched"),
    ("time_standard_over_detach", 5.0, True, "time standard / detach >= 5x"),
    ("time_exact_over_detach", 1.5, False, "time exact / detach <= 1.5x"),
)


def _gib(value: Any) -> str:
    return f"{value / GIB:.2f}" if isinstance(value, (int, float)) else "-"


def _verdict(value: float | None, threshold: float, at_least: bool) -> str:
    if value is None:
        return "not measured"
    return "met" if (value >= threshold if at_least else value <= threshold) else "NOT met"


def _forecast_ratio(results: list[dict[str, Any]], plan: str, g: Any) -> float | None:
    """standard_batched's forecast peak over `plan`'s measured peak at G = g, when only the forecast exists."""
    def at(m: str) -> dict[str, Any] | None:
        return next((r for r in results if r["plan"] == m and r["group_size"] == g), None)

    base, measured = at("standard_batched"), at(plan)
    if (not base or base.get("status") != "skipped" or not base.get("predicted_step_bytes") or not measured
            or measured.get("status") != "ok" or float(measured["peak_bytes"]) < PEAK_RESOLUTION):
        return None
    return float(base["predicted_step_bytes"]) / float(measured["peak_bytes"])


def markdown(summary: dict[str, Any]) -> str:
    """The run's tables: gpu tests, B1 per P with the targets, the longest exact step, sampling throughput."""
    machine = summary["machine"]
    cfg = summary["config"]
    out = [f"# bench/gpu.sh on {machine.get('gpu_name', machine.get('device'))}", "",
           f"{cfg['model']} {cfg['dtype']} on {cfg['device']}, torch {machine.get('torch')}, CUDA "
           f"{machine.get('cuda', '-')}; started {summary['started']}, {summary.get('wall_s', 0):.0f} s.", ""]
    tests = summary.get("tests")
    if tests:
        out += [f"gpu tests: **{tests['status']}** {tests['counts']} in {tests['wall_s']:.0f} s", ""]
    for p, b1 in summary.get("b1", {}).items():
        out += [f"## B1 at P = {p}, R = {cfg['response_tokens']}", "",
                "| plan | G | status | peak GiB | planner GiB | time s |", "|---|---|---|---|---|---|"]
        for r in b1["results"]:
            time_s = f"{r['time_s']:.2f}" if r.get("status") == "ok" else "-"
            out.append(f"| {r['plan']} | {r['group_size']} | {r.get('status')} | {_gib(r.get('peak_bytes'))} | "
                       f"{_gib(r.get('predicted_step_bytes'))} | {time_s} |")
        ratios = b1["ratios"]
        out += ["", f"Targets at G = {ratios.get('group_size')}:", ""]
        for key, threshold, at_least, text in TARGETS:
            value, note = ratios.get(key), ""
            if value is None and key.startswith("peak_standard_batched_over_"):
                value, note = _forecast_ratio(b1["results"], key.rsplit("_", 1)[1], ratios.get("group_size")), \
                    " from the planner's forecast of standard_batched, which was not run (beyond the device)"
            shown = f"{value:.2f}x" if isinstance(value, (int, float)) else "-"
            out.append(f"- {text}: {shown} ({_verdict(value, threshold, at_least)}{note if value else ''})")
        for plan, growth in ratios.get("peak_growth", {}).items():
            shown = f"{growth['pct']:+.1f}% (G {growth['from_g']} -> {growth['to_g']})" if growth else "-"
            ok = None if not growth else abs(growth["pct"])
            out.append(f"- {plan} peak flat in G (<= 5%): {shown} ({_verdict(ok, 5.0, False)})")
        out.append("")
    longest = summary.get("longest_exact")
    if longest is not None:
        rec = longest["record"]
        text = (f"P = {rec['prompt_tokens']} (G = {rec['group_size']}), peak {_gib(rec['peak_bytes'])} GiB, "
                f"{rec['time_s']:.1f} s" if rec else "none succeeded")
        out += ["## Longest exact step", "", f"Record: {text}; attempts (P, status): {longest['attempted']}; "
                f"P >= 131072: {'met' if rec and rec['prompt_tokens'] >= 131072 else 'NOT met'}", ""]
    decode = summary.get("decode")
    if decode:
        out += ["## Sampling throughput", "", decode.get("table", "(no table)"), ""]
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out-dir", help="where the JSON goes (default $OUT, else bench/results/gpu-<time>)")
    parser.add_argument("--device", help="cuda (default) or cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (with --device cpu: the dry run)")
    parser.add_argument("--deadline", type=float, help="seconds after which no configuration starts")
    parser.add_argument("--pareto", action="store_true", help="also run the Pareto sweep (part 4) if time remains")
    parser.add_argument("--no-tests", action="store_true", help="skip the gpu tests (part 0)")
    parser.add_argument("--no-plots", action="store_true", help="JSON and summary.md only (no PNGs)")


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of `python -m benchmarks gpu` (what bench/gpu.sh runs): exit status 0 if a check passed."""
    cfg = SMOKE if args.smoke else GpuBenchConfig()
    if args.device:
        check_device(args.device, args.fail)
        cfg = replace(cfg, device=args.device)
    if args.deadline:
        cfg = replace(cfg, deadline_s=args.deadline)
    if args.pareto:
        cfg = replace(cfg, pareto=True)
    if args.no_tests:
        cfg = replace(cfg, run_tests=False)
    if args.no_plots:
        cfg = replace(cfg, plots=False)
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            args.fail("no CUDA device here: use --device cpu --smoke for the dry run")
    out_dir = args.out_dir or os.environ.get("OUT") or os.path.join(
        "bench", "results", f"gpu-{time.strftime('%Y%m%d-%H%M%S')}")
    summary = run_gpu_bench(cfg, out_dir)
    return 0 if any(c["status"] == "ok" for c in summary["checks"]) else 1



BENCHMARKS = (
    Benchmark(
        name="gpu", help="the one-GPU run of bench/gpu.sh: gpu tests, B1, prompt sweep, decode, until a deadline",
        description=__doc__.splitlines()[0], add_arguments=add_arguments, run=run_from_args,
    ),
)
