"""`python -m benchmarks work`: the compute one step does, counted, from a baseline source tree and from this one.

Step times on a shared 2-core host move by ±10–40% from run to run (`versus`); the work a step does does not. This
bench runs one `backward_group` step per (plan, G) at Bench B1's shape, and one `backward_tree` step per plan over a
τ²-shaped tree, under torch.profiler with shapes recorded, from each tree in its own process, and counts what sets
the step's time: the matrix products (their number and FLOPs, 2·m·k·n each) and the attention kernel calls. Equal
counts mean the two trees run the same computation; what then differs in time is the host, or Python-side overhead
between the kernels (reported as the profiler's total self CPU time, which is as noisy as any timing). Beside the
counts, each case's top five ops by self CPU time with their share of the step's: where a step's time goes.
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
from benchmarks.machine import machine_info
from benchmarks.registry import Benchmark
from benchmarks.versus import baseline_tree
from longstraw.choices import PRESET_NAMES

ROOT = Path(__file__).resolve().parents[1]
CASES = (("standard", 2), ("detach", 2), ("exact", 2), ("detach", 16), ("exact", 16))
TREE = "2048,512,128,2,4"  # system prompt, task, response tokens; K tasks; G responses each
MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")
TOP = 5  # the ops with the most self CPU time, per case: the step's top costs

# One side's measurement, run as `python -c` with PYTHONPATH naming that tree's sources: prints one JSON row per case.
# argv: model, the group cases (JSON), P, R, the tree's "system,task,response,K,G".
_SIDE = """
import json, sys, torch
from torch.profiler import ProfilerActivity, profile
from longstraw import Group, Trajectory, backward_group, backward_tree, load_model


def measure(step, plan, g):
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in ops)
    row = {"plan": plan, "group_size": g, "matmuls": 0, "matmul_flops": 0, "attention_calls": 0,
           "self_cpu_s": total / 1e6,
           "top": [[e.key, e.self_cpu_time_total / 1e6, e.self_cpu_time_total / total, e.count] for e in ops[:TOP]]}
    for e in prof.events():
        shapes = [s for s in (e.input_shapes or []) if s]
        if e.name in MATMULS and len(shapes) >= 2 and len(shapes[-2]) == len(shapes[-1]) >= 2:
            a, b = shapes[-2], shapes[-1]  # (..., m, k) @ (..., k, n)
            batch = 1
            for d in a[:-2]:
                batch *= d
            row["matmuls"] += 1
            row["matmul_flops"] += 2 * batch * a[-2] * a[-1] * b[-1]
        elif "scaled_dot_product" in e.name or e.name in ("ChunkAttention", "ChunkAttentionBackward"):
            row["attention_calls"] += 1
    print(json.dumps(row), flush=True)


model = load_model(sys.argv[1])
vocab = model.config.vocab_size
for plan, g in json.loads(sys.argv[2]):
    torch.manual_seed(0)
    group = Group(prompt=torch.randint(0, vocab, (int(sys.argv[3]),)),
                  responses=[torch.randint(0, vocab, (int(sys.argv[4]),)) for _ in range(g)], advantages=torch.randn(g))
    model.zero_grad()
    measure(lambda: backward_group(model, group, plan=plan), plan, g)

# a τ²-shaped tree: one system prompt, K tasks after it, G responses to each
system, task, response, k, g = (int(x) for x in sys.argv[5].split(","))
torch.manual_seed(0)
head = torch.randint(0, vocab, (system,))
prompts = [torch.cat([head, torch.randint(0, vocab, (task,))]) for _ in range(k)]
trajectories = [Trajectory(ids=torch.cat([p, torch.randint(0, vocab, (response,))]), loss_start=p.numel(),
                           advantage=float(torch.randn(())), group=i)
                for i, p in enumerate(prompts) for _ in range(g)]
for plan in ("exact", "detach"):
    model.zero_grad()
    measure(lambda: backward_tree(model, trajectories, plan=plan), f"tree_{plan}", k * g)
"""


def count(tree: Path, model: str, prompt: int, response: int, shape: str = TREE) -> list[dict[str, Any]]:
    """Every case's counts from the source tree `tree` (its own process); `shape`: the tree's
    "system,task,response,K,G" tokens and counts."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    code = f"MATMULS = {MATMULS!r}\nTOP = {TOP}\n{_SIDE}"
    done = subprocess.run([sys.executable, "-c", code, model, json.dumps(CASES), str(prompt), str(response),
                           shape],
                          env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"counting from {tree} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def table(document: dict[str, Any]) -> str:
    lines = [f"{'plan':>9} {'G':>3} | {'matmuls base':>12} {'this':>6} | {'GFLOP base':>10} {'this':>9} {'ratio':>7} | "
             f"{'attention base':>14} {'this':>5} | {'self CPU s base':>15} {'this':>6}"]
    for r in document["results"]:
        b, t = r["baseline"], r["this"]
        lines.append(f"{r['plan']:>9} {r['group_size']:>3} | {b['matmuls']:>12} {t['matmuls']:>6} | "
                     f"{b['matmul_flops'] / 1e9:10.2f} {t['matmul_flops'] / 1e9:9.2f} {r['flops_ratio']:7.4f} | "
                     f"{b['attention_calls']:>14} {t['attention_calls']:>5} | {b['self_cpu_s']:15.2f} "
                     f"{t['self_cpu_s']:6.2f}")
    lines.append(f"top {TOP} ops by self CPU time, each side's share of its step's self CPU time (calls):")
    for r in document["results"]:
        for side in ("baseline", "this"):
            top = r[side].get("top") or []
            lines.append(f"  {r['plan']:>11} G={r['group_size']:<3} {side:<8} " + "; ".join(
                f"{name.removeprefix('aten::')} {share:.0%} ({calls})" for name, _, share, calls in top))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    baseline = baseline_tree(args.baseline)
    document: dict[str, Any] = {"bench": "work", "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                "config": {"baseline": str(baseline), "this": str(ROOT), "model": args.model,
                                           "prompt_tokens": args.prompt_tokens, "tree": args.tree,
                                           "response_tokens": args.response_tokens},
                                "machine": machine_info("cpu")}
    sides = {side: count(tree, args.model, args.prompt_tokens, args.response_tokens, args.tree)
             for side, tree in (("baseline", baseline), ("this", ROOT))}
    document["results"] = [
        {"plan": b["plan"], "group_size": b["group_size"], "status": "ok", "baseline": b, "this": t,
         "flops_ratio": t["matmul_flops"] / b["matmul_flops"]}
        for b, t in zip(sides["baseline"], sides["this"])]
    return finish_run(document, table, args.out or default_out("work", False), "work")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", required=True, metavar="DIR", help="a source tree of an earlier commit")
    parser.add_argument("--model", default="b1-llama",
                        help=f"a preset ({', '.join(PRESET_NAMES)}); default b1-llama, Bench B1's model")
    parser.add_argument("--prompt-tokens", type=int, default=4096, help="P (default 4096, B1's)")
    parser.add_argument("--response-tokens", type=int, default=256, help="R (default 256, B1's)")
    parser.add_argument("--tree", default=TREE, help=f"the tree's system,task,response tokens,K,G (default {TREE})")
    parser.add_argument("--out", help="result JSON (default bench/results/work-<YYYYmmdd-HHMMSS>.json)")


BENCHMARKS = (Benchmark("work", "the compute of one step (matmul FLOPs, attention calls) from a baseline tree and "
                        "this one", "Counts, under torch.profiler, the matrix products and attention calls of one "
                        "backward_group step per plan and G at Bench B1's shape, from --baseline and from this tree.",
                        add_arguments, run, table),)
