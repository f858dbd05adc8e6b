"""What `bench/gpu.sh` runs: Bench B1's comparison at a GPU-sized shape and the Pareto sweep, in one call with a
wall-clock deadline (8 minutes on one H200, per the issue), every configuration in a fresh worker.

Default (GPU) run: `gpu-llama-1b` (1.26B parameters, random init, bf16) on `cuda`:
  1. B1 comparison: P in {32768, 65536}, R = 512, G in {2, 8}, all four plans. P = 32768 is where `standard`
     still fits an H200 (so time ratios against it exist); at P = 65536 the planner predicts it does not.
  2. Pareto: P = 65536, R = 512, G = 8, micro-batch {1, 2, 4, 8} x chunk {8192, 32768}, detach and exact.
A configuration the planner predicts above the GPU's memory by more than 15% is skipped (recorded, not run);
one predicted near the limit runs and may fail with an OOM, which is recorded. Configurations that would start
after the deadline are recorded as skipped. Each result carries the planner's prediction beside the measured
peak (`torch.cuda.max_memory_allocated` after a reset), so a GPU run also checks the planner.

`--device cpu --smoke` is the dry run: tiny-llama, fp32, seconds; the test suite runs it.
Output directory: `--out-dir`, else `$OUT`, else bench/results/gpu-<timestamp>: memory-P<P>.json,
pareto.json, summary.json and PNGs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from longstraw.bench.common import (
    B1,
    GIB,
    MIB,
    PLANNER_SLACK,
    MemoryBenchConfig,
    predictor,
    run_batch,
    run_one,
    write_json,
)
from longstraw.bench.machine import machine_info
from longstraw.bench.memory import compute_ratios
from longstraw.choices import PLANS_BASELINE_FIRST


@dataclass(frozen=True)
class GpuBenchConfig:
    model: str = "gpu-llama-1b"
    dtype: str = "bfloat16"
    device: str = "cuda"
    prompts: tuple[int, ...] = (32768, 65536)
    response_tokens: int = 512
    groups: tuple[int, ...] = (2, 8)
    plans: tuple[str, ...] = PLANS_BASELINE_FIRST
    chunk_size: int = 8192
    pareto_prompt: int = 65536
    pareto_group: int = 8
    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    chunk_sizes: tuple[int, ...] = (8192, 32768)
    deadline_s: float = 450.0  # stop starting configurations after this (the call's limit is 8 min)
    config_timeout_s: float = 150.0
    reserve_bytes: int = GIB  # CUDA context etc., for the planner's skip decision
    isolate: bool = True  # a fresh worker per configuration; False (smoke): one worker per part


SMOKE = replace(GpuBenchConfig(), model="tiny-llama", dtype="float32", device="cpu", prompts=(64,),
                response_tokens=8, groups=(2,), chunk_size=32, pareto_prompt=64, pareto_group=4,
                micro_batches=(1, 2), chunk_sizes=(32,), deadline_s=120.0, config_timeout_s=60.0, isolate=False)


def _device_memory(device: str) -> int | None:
    """Total memory of the CUDA device (None on CPU or when CUDA is unavailable)."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.device(device).index or 0).total_memory


def run_gpu_bench(cfg: GpuBenchConfig, out_dir: str) -> dict[str, Any]:
    """Run part 1 (B1 comparison per P) then part 2 (Pareto); write every document into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.perf_counter()
    machine = machine_info(cfg.device)
    memory = _device_memory(cfg.device)
    predict = predictor(cfg.model, cfg.dtype, cfg.device)
    summary: dict[str, Any] = {"config": asdict(cfg), "machine": machine, "device_memory_bytes": memory,
                               "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "documents": [], "checks": []}

    def run(jobs: list[tuple[MemoryBenchConfig, str, int, str]]) -> list[dict[str, Any]]:
        """Decide skips (planner, deadline), run the rest (one worker each, or one for all in smoke runs)."""
        entries: list[dict[str, Any]] = []
        for job, mode, g, _ in jobs:
            predicted = predict(job.prompt_tokens, cfg.response_tokens, g, mode, job.chunk_size,
                                job.micro_batch) if predict else None
            entry: dict[str, Any] = {"mode": mode, "group_size": g, "prompt_tokens": job.prompt_tokens,
                                     "chunk_size": job.chunk_size, "micro_batch": job.micro_batch,
                                     "predicted_step_bytes": predicted}
            if (memory is not None and predicted is not None
                    and predicted > (memory - cfg.reserve_bytes) * (1 + PLANNER_SLACK)):
                entry.update(status="skipped", error=f"planner predicts {predicted / MIB:.0f} MiB > device memory")
            entries.append(entry)
        todo = [(i, jobs[i]) for i, e in enumerate(entries) if "status" not in e]
        if cfg.isolate:
            for i, (job, mode, g, _) in todo:
                remaining = cfg.deadline_s - (time.perf_counter() - t_start)
                if remaining < 10:
                    entries[i].update(status="skipped", error="deadline reached")
                    continue
                entries[i].update(run_one(replace(job, timeout_s=min(cfg.config_timeout_s, remaining)), mode, g))
        else:
            measured = run_batch([(job, mode, g) for _, (job, mode, g, _) in todo], isolate=False)
            for (i, _), m in zip(todo, measured):
                entries[i].update(m)
        for entry, (job, mode, _, label) in zip(entries, jobs):
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
            print(f"[{time.perf_counter() - t_start:5.0f} s] {label:<24} {mode:<17} {note}", file=sys.stderr,
                  flush=True)
            summary["checks"].append({k: entry.get(k) for k in (
                "mode", "group_size", "prompt_tokens", "micro_batch", "chunk_size", "status", "peak_bytes",
                "predicted_step_bytes", "time_s")})
        return entries

    base = replace(B1, model=cfg.model, dtype=cfg.dtype, device=cfg.device, response_tokens=cfg.response_tokens,
                   chunk_size=cfg.chunk_size, groups=cfg.groups, plans=cfg.plans)
    from longstraw.bench.plots import plot_memory, plot_pareto

    for p in cfg.prompts:
        job = replace(base, prompt_tokens=p)
        results = run([(job, mode, g, f"B1 P={p} G={g}") for g in cfg.groups for mode in cfg.plans])
        doc = {"bench": "memory", "started": summary["started"], "config": asdict(job), "machine": machine,
               "results": results, "ratios": compute_ratios(results)}
        path = os.path.join(out_dir, f"memory-P{p}.json")
        write_json(path, doc)
        plot_memory(doc, os.path.splitext(path)[0] + ".png")
        summary["documents"].append(path)

    pareto_job = replace(base, prompt_tokens=cfg.pareto_prompt)
    results = run([(replace(pareto_job, micro_batch=k, chunk_size=c), mode, cfg.pareto_group,
                    f"pareto k={k} chunk={c}")
                   for mode in ("detach", "exact") for k in cfg.micro_batches for c in cfg.chunk_sizes])
    from longstraw.bench.pareto import pareto_flags

    for mode in ("detach", "exact"):
        ok = [r for r in results if r["mode"] == mode and r.get("status") == "ok"]
        for r, flag in zip(ok, pareto_flags([(r["peak_bytes"], r["time_s"]) for r in ok])):
            r["pareto"] = flag
    pareto_cfg = {"model": cfg.model, "prompt_tokens": cfg.pareto_prompt, "response_tokens": cfg.response_tokens,
                  "group_size": cfg.pareto_group, "micro_batches": list(cfg.micro_batches),
                  "chunk_sizes": list(cfg.chunk_sizes), "dtype": cfg.dtype, "device": cfg.device}
    doc = {"bench": "pareto", "started": summary["started"], "config": pareto_cfg, "machine": machine,
           "results": results}
    path = os.path.join(out_dir, "pareto.json")
    write_json(path, doc)
    plot_pareto(doc, os.path.splitext(path)[0] + ".png")
    summary["documents"].append(path)
    summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    summary["wall_s"] = time.perf_counter() - t_start
    write_json(os.path.join(out_dir, "summary.json"), summary)
    checks = summary["checks"]
    n_ok = sum(1 for c in checks if c["status"] == "ok")
    print(f"gpu bench: {n_ok}/{len(checks)} configurations ok in {summary['wall_s']:.0f} s; results in {out_dir}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m longstraw.bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", help="where the JSON goes (default $OUT, else bench/results/gpu-<time>)")
    parser.add_argument("--device", help="cuda (default) or cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (with --device cpu: the dry run)")
    parser.add_argument("--deadline", type=float, help="seconds after which no configuration starts")
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else GpuBenchConfig()
    if args.device:
        if args.device != "cpu" and not args.device.startswith("cuda"):
            parser.error(f"--device must be cpu or cuda[:i], got {args.device!r}")
        cfg = replace(cfg, device=args.device)
    if args.deadline:
        cfg = replace(cfg, deadline_s=args.deadline)
    if cfg.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("no CUDA device here: use --device cpu --smoke for the dry run")
    out_dir = args.out_dir or os.environ.get("OUT") or os.path.join(
        "bench", "results", f"gpu-{time.strftime('%Y%m%d-%H%M%S')}")
    summary = run_gpu_bench(cfg, out_dir)
    return 0 if any(c["status"] == "ok" for c in summary["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
