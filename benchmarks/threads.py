"""`python -m benchmarks threads`: where a step's time goes as torch's intra-op threads are added.

The FLOP floor (`flops.py`) counts operations; a measured standard/plan ratio also measures how well each plan's
kernels use the cores. This bench runs the same `backward_group` steps (one per plan, Bench B1's model and a chosen
P, R, G) in one process per thread count (`OMP_NUM_THREADS`, every other variable inherited: `python -m benchmarks`
sets `OMP_WAIT_POLICY=PASSIVE`), times `--steps` warm steps per plan, then profiles one more with input shapes
recorded. It reports each plan's step time per thread count, its speedup, its share of the FLOP floor at each count,
and the ops (by name and input shapes) that lose the most time against a perfect speedup at the largest count:
self time at N threads minus self time at one thread over N.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import default_out, finish_run
from benchmarks.flops import group_floor, preset_costs
from benchmarks.machine import machine_info
from benchmarks.registry import Benchmark
from longstraw.choices import PRESET_NAMES
from longstraw.planner import non_negative_int, positive_int

ROOT = Path(__file__).resolve().parents[1]
TOP = 8  # the ops the table lists per plan: the most time lost against a perfect speedup

# One thread count's measurement, run as `python -c` in its own process: prints one JSON row per plan.
# argv: model, P, R, G, warm steps, timed steps, the plans (JSON).
_SIDE = """
import json, statistics, sys, time, torch
from torch.profiler import ProfilerActivity, profile
from longstraw import Group, backward_group, load_model

model = load_model(sys.argv[1])
prompt, response, g, warm, steps = (int(x) for x in sys.argv[2:7])
vocab = model.config.vocab_size
torch.manual_seed(0)
group = Group(prompt=torch.randint(0, vocab, (prompt,)),
              responses=[torch.randint(0, vocab, (response,)) for _ in range(g)], advantages=torch.randn(g))
for plan in json.loads(sys.argv[7]):
    def step():
        model.zero_grad(set_to_none=True)
        backward_group(model, group, plan=plan)
    for _ in range(warm):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    ops = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)  # all of them
    print(json.dumps({"plan": plan, "threads": torch.get_num_threads(), "time_s": statistics.median(times),
                      "times_s": times,
                      "ops": [[e.key, str(e.input_shapes), e.self_cpu_time_total / 1e6, e.count]
                              for e in ops]}), flush=True)
"""


def measure(threads: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every plan's row at `threads` torch threads, from a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT / "src"))
    argv = [args.model, str(args.prompt_tokens), str(args.response_tokens), str(args.groups), str(args.warm_steps),
            str(args.steps), json.dumps(args.plans)]
    done = subprocess.run([sys.executable, "-c", _SIDE, *argv], env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the run with {threads} thread(s) failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def summarize(runs: dict[int, list[dict[str, Any]]], floors: dict[str, float | None]) -> list[dict[str, Any]]:
    """One result per plan: time per thread count, speedup from the lowest count to the highest, share of the FLOP
    floor per thread count (standard's time over the plan's, over the floor), and the ops that lose the most against
    a perfect speedup."""
    counts = sorted(runs)
    low, high = counts[0], counts[-1]
    by = {n: {r["plan"]: r for r in rows} for n, rows in runs.items()}
    results = []
    for plan in by[low]:
        times = {n: by[n][plan]["time_s"] for n in counts}
        floor = floors.get(plan)
        shares = {n: (by[n]["standard"]["time_s"] / times[n] / floor if "standard" in by[n] and floor else None)
                  for n in counts}
        one = {(name, shapes): s for name, shapes, s, _ in by[low][plan]["ops"]}
        # [name, shapes, self s at the lowest count (None: not run there), at the highest, calls, lost s]
        lost = sorted(([name, shapes, one.get((name, shapes)), s, calls, s - one.get((name, shapes), 0.0) * low / high]
                       for name, shapes, s, calls in by[high][plan]["ops"]), key=lambda op: -op[5])
        results.append({"plan": plan, "status": "ok", "time_s": {str(n): times[n] for n in counts},
                        "speedup": times[low] / times[high], "floor": floor,
                        "floor_share": {str(n): shares[n] for n in counts},
                        "lost_s": times[high] - times[low] * low / high, "top_lost": lost[:TOP]})
    return results


def table(document: dict[str, Any]) -> str:
    counts = document["config"]["threads"]
    lo, hi = str(counts[0]), str(counts[-1])
    lines = [f"{'plan':>9} | " + " ".join(f"{'s @' + str(n):>8}" for n in counts) + f" | {'speedup':>7} | "
             + " ".join(f"{'share @' + str(n):>9}" for n in counts) + f" | {'floor':>6} | lost s @{hi}"]
    for r in document["results"]:
        shares = " ".join(f"{r['floor_share'][str(n)]:9.2f}" if r["floor_share"][str(n)] is not None else f"{'-':>9}"
                          for n in counts)
        floor = f"{r['floor']:6.2f}" if r["floor"] else f"{'-':>6}"
        lines.append(f"{r['plan']:>9} | " + " ".join(f"{r['time_s'][str(n)]:8.3f}" for n in counts)
                     + f" | {r['speedup']:7.2f} | {shares} | {floor} | {r['lost_s']:.3f}")
    lines.append(f"ops losing the most time at {hi} threads against {lo}'s self time over {int(hi) / int(lo):g} "
                 f"(self s @{lo}, @{hi}, calls, lost s):")
    for r in document["results"]:
        for name, shapes, one, many, calls, lost in r["top_lost"]:
            at_one = f"{one:.3f}" if one is not None else f"- (not run @{lo}: other ops do its work there)"
            lines.append(f"  {r['plan']:>9} {name.removeprefix('aten::')} {shapes[:70]} {at_one} {many:.3f} "
                         f"{calls} {lost:+.3f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if len(args.threads) < 2 or sorted(set(args.threads)) != args.threads:
        args.fail("--threads takes two or more increasing counts, e.g. --threads 1 2")
    document: dict[str, Any] = {"bench": "threads", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                "config": {"model": args.model, "prompt_tokens": args.prompt_tokens,
                                           "response_tokens": args.response_tokens, "group_size": args.groups,
                                           "plans": args.plans, "threads": args.threads,
                                           "warm_steps": args.warm_steps, "steps": args.steps},
                                "machine": machine_info("cpu")}
    runs = {}
    for n in args.threads:
        print(f"{n} thread(s): {', '.join(args.plans)}", flush=True)
        runs[n] = measure(n, args)
    costs = preset_costs(args.model)
    floors = {plan: group_floor(costs, plan, args.prompt_tokens, args.response_tokens, args.groups)
              for plan in args.plans}
    document["runs"] = {str(n): rows for n, rows in runs.items()}
    document["results"] = summarize(runs, floors)
    return finish_run(document, table, args.out or default_out("threads", False), "threads")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="b1-llama", choices=PRESET_NAMES,
                        help="a preset; default b1-llama, Bench B1's model")
    parser.add_argument("--prompt-tokens", type=positive_int, default=2048, help="P (default 2048)")
    parser.add_argument("--response-tokens", type=positive_int, default=128, help="R (default 128)")
    parser.add_argument("--groups", type=positive_int, default=8, help="G (default 8)")
    parser.add_argument("--plans", nargs="+", choices=("standard", "detach", "exact"),
                        default=["standard", "detach", "exact"], help="default: all three; the floor share needs "
                        "standard")
    parser.add_argument("--threads", nargs="+", type=positive_int, default=[1, 2],
                        help="torch thread counts, increasing (default 1 2)")
    parser.add_argument("--warm-steps", type=non_negative_int, default=1,
                        help="untimed steps per plan first (default 1)")
    parser.add_argument("--steps", type=positive_int, default=3, help="timed steps per plan, median (default 3)")
    parser.add_argument("--out", help="result JSON (default bench/results/threads-<YYYYmmdd-HHMMSS>.json)")


BENCHMARKS = (Benchmark("threads", "a B1 step per plan at 1 and more torch threads: speedup, FLOP-floor share, the "
                        "ops that scale worst", "Times and profiles one backward_group step per plan at Bench B1's "
                        "model in one process per torch thread count, and lists the ops that lose the most time "
                        "against a perfect speedup.", add_arguments, run, table),)
