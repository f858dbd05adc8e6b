"""`python -m benchmarks provenance`: what recording and checking a prompt state's provenance costs at 1B+ parameters.

`engine/state/provenance.py` records, at capture, the model's identity, config, module attributes, adapter state and
a checksum of every value of every parameter and buffer (integer row and column sums), and recomputes and compares
it at every check of a reused state. This bench times both on a real model: every parameter a materialised tensor
of the given dtype with random values (`normal_(0, 0.02)`), the default a Qwen2-1.5B-shaped model (28 layers, hidden
1536, vocabulary 151936, tied embeddings: 1.54B parameters), built from its config without downloading weights.
capture: `provenance(model)`, what `capture_prompt` pays; check: `mismatch(captured, provenance(model))`, what each
entry point given a reused state pays. It reports each timed call, the median and the tensor counts, and the host's
load (`uptime`) before and after; table on stdout, JSON in --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import check_out, default_out, write_results
from benchmarks.machine import machine_info
from benchmarks.registry import Benchmark

# Qwen/Qwen2-1.5B's config.json, the fields that fix its parameter shapes.
QWEN2_1_5B = dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=131072,
                  tie_word_embeddings=True)
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-1.5b-shaped": QWEN2_1_5B,
    "smoke": dict(QWEN2_1_5B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=512),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", choices=[s for s in SHAPES if s != "smoke"], default="qwen2-1.5b-shaped",
                        help="model shape (default qwen2-1.5b-shaped: 1.54B parameters, 6.2 GB in float32)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="parameter dtype (default float32)")
    parser.add_argument("--repeats", type=int, default=20,
                        help="timed captures and timed checks, each after one warm-up (default 20)")
    parser.add_argument("--smoke", action="store_true", help="a 2-layer model of the same layout: seconds")
    parser.add_argument("--out", default=None, help="JSON path (default bench/results/provenance-<time>.json; "
                                                    "--smoke: under bench/results/smoke/)")


def build_model(fields: dict[str, Any], dtype: str) -> Any:
    """The causal LM of `fields` with every parameter materialised and random (no download, no slow init)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = dict(fields)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives every parameter its own storage, the tied output projection included
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def _timed(call: Callable[[], object], repeats: int) -> dict[str, Any]:
    """One warm-up call, then `repeats` timed ones (milliseconds)."""
    call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return {"times_ms": [round(t, 3) for t in times], "median_ms": round(statistics.median(times), 3),
            "min_ms": round(min(times), 3)}


def measure(model: Any, repeats: int) -> dict[str, Any]:
    """The provenance recorded at capture and the check of a reused state, each timed `repeats` times."""
    from longstraw.engine.state.provenance import mismatch, provenance

    captured = provenance(model)
    capture = _timed(lambda: provenance(model), repeats)
    check = _timed(lambda: mismatch(captured, provenance(model)), repeats)
    if mismatch(captured, provenance(model)) is not None:
        raise RuntimeError("the unchanged model refused its own provenance: the bench measured a false refusal")
    params, buffers = list(model.parameters()), list(model.buffers())
    return {"parameters": sum(p.numel() for p in params), "tensors": len(params), "buffers": len(buffers),
            "bytes": sum(t.numel() * t.element_size() for t in params + buffers),
            "module_attributes": len(captured.attributes), "config_entries": len(captured.config),
            "capture": capture, "check": check}


def _uptime() -> str:
    """`uptime`'s line (the host's load: other work on it slows every timing)."""
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError) as err:
        return f"uptime unavailable: {err}"


def format_table(document: dict[str, Any]) -> str:
    r = document["result"]
    return "\n".join([
        "| model | dtype | parameters | tensors | capture median (ms) | capture min (ms) | check median (ms) | "
        "check min (ms) | repeats |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {document['shape']} | {document['dtype']} | {r['parameters'] / 1e9:.2f}B | {r['tensors']} + "
        f"{r['buffers']} buffers | {r['capture']['median_ms']:.1f} | {r['capture']['min_ms']:.1f} | "
        f"{r['check']['median_ms']:.1f} | {r['check']['min_ms']:.1f} | {len(r['check']['times_ms'])} |",
    ])


def run_from_args(args: argparse.Namespace) -> int:
    """Entry point of `python -m benchmarks provenance`."""
    check_out(args.out, args.fail)
    if args.repeats < 1:
        args.fail(f"--repeats must be >= 1, got {args.repeats}")
    shape = "smoke" if args.smoke else args.shape
    out = args.out or default_out("provenance", args.smoke)
    t0 = time.perf_counter()
    model = build_model(SHAPES[shape], args.dtype)
    build_s = time.perf_counter() - t0
    uptime_before = _uptime()
    result = measure(model, args.repeats)
    document = {"bench": "provenance", "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "shape": shape,
                "config": SHAPES[shape], "dtype": args.dtype, "smoke": args.smoke, "build_s": round(build_s, 1),
                "what": "capture: engine.state.provenance.provenance(model): the identity fields, parameter and "
                        "buffer layout digests, config entries, module attributes, adapter state, and the integer "
                        "row and column sums of every parameter and buffer, hashed per tensor; check: "
                        "mismatch(captured, provenance(model))",
                "uptime_before": uptime_before, "uptime_after": _uptime(),
                "machine": machine_info("cpu"), "result": result}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    written = write_results(out, document, "bench provenance")
    print(format_table(document))
    print(f"bench provenance: results in {written}")
    return 0


BENCHMARKS = (
    Benchmark(
        name="provenance",
        help="the cost of a prompt state's provenance digest (capture and each check) at 1.5B parameters",
        description="Times engine.state.provenance.provenance on a materialised Qwen2-1.5B-shaped model (random "
                    "weights, no download): the digest paid at capture and at each check of a reused prompt state; "
                    "table and JSON.",
        add_arguments=add_arguments, run=run_from_args, table=format_table,
    ),
)
