"""The stress record: the longest prompt one GRPO step (`backward_group`) completes on this machine.

`python -m benchmarks stress --model tiny-llama-long --plan exact --group-size 4 --response-tokens 128`
doubles P from `--start` until a step fails, exceeds `--step-timeout`, or the planner predicts more than
`--budget`; every step runs in a fresh bench worker (peak = VmHWM above the loaded model, docs/design.md §5; the
whole process's high-water mark is recorded too). Any preset works (`--model`), so a constant-state model (Mamba2,
a sliding-window hybrid) needs only a run. Results go to bench/results/stress-<model>-<time>.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from typing import Any

from benchmarks.common import B1, GIB, MIB, predictor, run_one, write_json
from benchmarks.machine import machine_info
from benchmarks.registry import Benchmark
from longstraw.choices import PLANS, PRESET_NAMES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-llama-long", help=f"a preset ({', '.join(PRESET_NAMES)}), a "
                        "local directory or a Hugging Face id (default tiny-llama-long)")
    parser.add_argument("--plan", dest="plan", default="exact", choices=PLANS,
                        help="the plan (default exact)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--response-tokens", type=int, default=128)
    parser.add_argument("--start", type=int, default=32768, help="first prompt length")
    parser.add_argument("--max-prompt", type=int, default=2**24, help="stop after this prompt length")
    parser.add_argument("--chunk-size", type=int, default=8192)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--budget", default="16GiB", help="skip a P the planner predicts above this (step memory)")
    parser.add_argument("--step-timeout", type=float, default=1800.0, help="seconds one step may take")
    parser.add_argument("--out", help="result JSON")


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of `python -m benchmarks stress`: exit status 0 if a step ran."""
    from longstraw.planner import parse_size

    try:
        budget = parse_size(args.budget)
    except ValueError as err:
        args.fail(str(err))
    if args.start < 2 or args.group_size < 1 or args.response_tokens < 1:
        args.fail("--start must be >= 2, --group-size and --response-tokens >= 1")
    out = args.out or os.path.join(
        "bench", "results", f"stress-{args.model.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)

    predict = predictor(args.model, args.dtype)
    document: dict[str, Any] = {
        "bench": "stress", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine_info("cpu"),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "bench", "fail", "run", "table")},
        "command": " ".join(sys.argv),
        "results": [],
    }
    results: list[dict] = document["results"]
    base = replace(B1, model=args.model, dtype=args.dtype, response_tokens=args.response_tokens,
                   chunk_size=args.chunk_size, timeout_s=args.step_timeout)
    p = args.start
    while p <= args.max_prompt:
        predicted = predict(p, args.response_tokens, args.group_size, args.plan, args.chunk_size,
                            1) if predict else None
        if predicted is not None and predicted > budget:
            results.append({"prompt_tokens": p, "status": "skipped", "predicted_step_bytes": predicted,
                            "error": f"planner predicts {predicted / GIB:.2f} GiB > budget {budget / GIB:.2f} GiB"})
            print(f"P={p}: skipped ({results[-1]['error']})", file=sys.stderr)
            break
        entry = run_one(replace(base, prompt_tokens=p), args.plan, args.group_size)
        entry.update(prompt_tokens=p, predicted_step_bytes=predicted)
        results.append(entry)
        if entry["status"] == "ok":
            print(f"P={p}: ok, step {entry['time_s']:.1f} s, step peak {entry['peak_bytes'] / MIB:.1f} MiB, "
                  f"process high-water {entry['high_water_bytes'] / MIB:.1f} MiB"
                  + (f" (planner {predicted / MIB:.1f} MiB)" if predicted else ""), file=sys.stderr, flush=True)
        else:
            print(f"P={p}: {entry['error']}", file=sys.stderr, flush=True)
        write_json(out, document)
        if entry["status"] != "ok":
            break
        p *= 2
    ok = [r for r in results if r["status"] == "ok"]
    document["record"] = max(ok, key=lambda r: r["prompt_tokens"]) if ok else None
    document["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    write_json(out, document)
    if ok:
        r = document["record"]
        print(f"record: {args.model} {args.plan} G={args.group_size} R={args.response_tokens}: "
              f"P={r['prompt_tokens']} positions in {r['time_s']:.0f} s, step peak {r['peak_bytes'] / MIB:.0f} MiB, "
              f"process high-water {r['high_water_bytes'] / MIB:.0f} MiB; results: {out}")
        return 0
    print(f"no prompt length succeeded; results: {out}", file=sys.stderr)
    return 1



BENCHMARKS = (
    Benchmark(
        name="stress", help="the stress record: doubles P until one GRPO step fails or passes --step-timeout",
        description=__doc__.splitlines()[0], add_arguments=add_arguments, run=run_from_args,
    ),
)
