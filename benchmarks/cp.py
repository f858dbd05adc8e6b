"""`python -m benchmarks cp`: context-parallel prompt state, per-rank peak memory and time for C ∈ {1, 2, 4}; with
`--tp`, every (C, T) pair, the model split by heads over T ranks (tensor parallelism, `distributed/tp.py`).

Each C runs as C fresh processes (C x T with tensor parallelism) on this machine (gloo, torchrun's environment),
one `backward_group` each on the same group with the prompt state sharded over the C ranks (`distributed/context.py`)
and by heads over the T ranks. Reported per row: the largest per-rank peak (VmHWM − RSS before the step,
docs/design.md §5), the prompt-state bytes a rank holds, and the step time. On one CPU host the ranks share the
cores, so times measure the method's overhead (every context-parallel rank repeats the non-attention work of every
segment; tensor-parallel ranks add two all-reduces per layer), not a multi-GPU speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import check_model, check_out, default_out, write_results
from benchmarks.launch import free_port, rank_env, run_ranks, worker_command
from benchmarks.machine import machine_info
from benchmarks.registry import Benchmark
from longstraw.choices import PRESET_NAMES
from longstraw.planner import MIB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="b1-llama", help=f"a preset ({', '.join(PRESET_NAMES)}), a local "
                                                            "directory or a Hugging Face id (default b1-llama)")
    parser.add_argument("--prompt-tokens", type=int, default=8192, help="P (default 8192)")
    parser.add_argument("--response-tokens", type=int, default=128, help="R (default 128)")
    parser.add_argument("--group-size", type=int, default=2, help="G (default 2)")
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes (default 1 2 4)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1],
                        help="tensor-parallel sizes, each run with every --cp size (default 1)")
    parser.add_argument("--plan", dest="plan", choices=("detach", "exact"), default="exact",
                        help="plan (default exact)")
    parser.add_argument("--chunk-size", type=int, default=1024, help="prompt capture chunk (default 1024)")
    parser.add_argument("--dtype", default="float32", help="parameter dtype (default float32)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per C before giving up")
    parser.add_argument("--smoke", action="store_true", help="tiny-llama, P=256, C in {1, 2}: seconds")
    parser.add_argument("--out", default=None,
                        help="JSON path (default bench/results/cp-<time>.json; --smoke: under bench/results/smoke/)")


def measure_ranks(config: dict, timeout: float) -> list[dict]:
    """Run C ranks of the worker; return each rank's measurement. Raises RuntimeError with a rank's output."""
    world = int(config["cp"]) * int(config.get("tp", 1))
    port = free_port()
    threads = str(max(1, (os.cpu_count() or 1) // world))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cp")
        envs = [rank_env(os.environ, rank, world, port, OMP_NUM_THREADS=threads, MALLOC_MMAP_THRESHOLD_="131072")
                for rank in range(world)]
        codes, outputs, timed_out = run_ranks(worker_command("cp_worker", json.dumps(config), out), envs, timeout)
        if timed_out:
            raise RuntimeError(f"C={world}: ranks did not finish within {timeout:.0f} s")
        for code, text in zip(codes, outputs):
            if code != 0:
                raise RuntimeError(f"C={world}: a rank failed (exit {code}):\n{text[-2000:]}")
        return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(world)]


def run_from_args(args: argparse.Namespace) -> int:
    check_out(args.out, args.fail)
    base = {"model": args.model, "dtype": args.dtype, "prompt_tokens": args.prompt_tokens,
            "response_tokens": args.response_tokens, "group_size": args.group_size, "plan": args.plan,
            "chunk_size": args.chunk_size, "seed": 0}
    sizes = args.cp
    if args.smoke:
        base.update(model="tiny-llama", prompt_tokens=256, response_tokens=8, chunk_size=32)
        sizes = [1, 2]
    if any(c < 1 for c in sizes):
        args.fail("--cp sizes must be >= 1")
    if any(t < 1 for t in args.tp):
        args.fail("--tp sizes must be >= 1")
    layouts = [(c, t) for t in args.tp for c in sizes]
    check_model(base["model"], args.fail)
    print(f"bench cp: {base['model']} {base['dtype']}, P={base['prompt_tokens']} R={base['response_tokens']} "
          f"G={base['group_size']}, {base['plan']}, chunk {base['chunk_size']}; (C, TP) in {layouts}, one process "
          "per rank")
    rows = []
    for c, t in layouts:
        t0 = time.perf_counter()
        try:
            ranks = measure_ranks(base | {"cp": c, "tp": t}, args.timeout)
        except RuntimeError as err:
            print(f"python -m benchmarks cp: error: {err}", file=sys.stderr)
            return 1
        row = {"cp": c, "tp": t, "status": "ok", "ranks": ranks, "max_peak_bytes": max(r["peak_bytes"] for r in ranks),
               "max_state_bytes": max(r["prompt_state_bytes"] for r in ranks),
               "max_time_s": max(r["time_s"] for r in ranks), "wall_s": time.perf_counter() - t0}
        rows.append(row)
        print(f"  C={c} TP={t}: per-rank peak {row['max_peak_bytes'] / MIB:8.1f} MiB  prompt state "
              f"{row['max_state_bytes'] / MIB:7.2f} MiB  step {row['max_time_s']:7.2f} s")
    one = rows[0]
    print("relative to the first row:")
    for row in rows[1:]:
        state = row["max_state_bytes"] / one["max_state_bytes"]
        peak, step = row["max_peak_bytes"] / one["max_peak_bytes"], row["max_time_s"] / one["max_time_s"]
        print(f"  C={row['cp']} TP={row['tp']}: state x{state:.3f}, peak x{peak:.3f}, time x{step:.2f}")
    out = Path(args.out or default_out("cp", args.smoke))
    out.parent.mkdir(parents=True, exist_ok=True)
    written = write_results(str(out), {"config": base, "machine": machine_info("cpu"), "results": rows}, "bench cp")
    print(f"results: {written}")
    return 0


BENCHMARKS = (
    Benchmark(
        name="cp", help="context-parallel prompt state: per-rank peak memory and time for C in {1, 2, 4}",
        description="Each C as C processes (gloo) sharing one prompt's state; per-rank peak, state bytes, time.",
        add_arguments=add_arguments, run=run_from_args,
    ),
)
