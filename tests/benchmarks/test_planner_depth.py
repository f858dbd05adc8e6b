"""The planner at depth: a 30-layer model (deep-smollm2, SmolLM2-135M's shape) measured against the forecast,
with and without per-layer activation checkpointing, every plan that fits this machine.

The default suite runs a short prompt (the checkpointed replay plans, where checkpointing changes the forecast
most); `make test-long` runs P = 16,384 (docs/planner.md: an hour and a half on 2 cores, outside CI).
Bound: ±10% of the measured step peak."""

from __future__ import annotations

from dataclasses import replace

import pytest

from benchmarks.common import B1, predictor, run_one

TOLERANCE = 0.10
MODEL = "deep-smollm2"


def _measure(prompt_tokens: int, response_tokens: int, cases: list[tuple[str, str]], group_size: int = 2):
    bench = replace(B1, model=MODEL, prompt_tokens=prompt_tokens, response_tokens=response_tokens, chunk_size=2048)
    predict = predictor(MODEL, "float32")
    rows = []
    for plan, checkpoint in cases:
        entry = run_one(bench, plan, group_size, checkpoint)
        assert entry["status"] == "ok", f"{plan}/{checkpoint}: {entry.get('error')}\n{entry.get('stderr_tail')}"
        predicted = predict(prompt_tokens, response_tokens, group_size, plan, bench.chunk_size, 1,
                            checkpoint_layers=checkpoint == "layers")
        rows.append((plan, checkpoint, entry["peak_bytes"], predicted))
    report = "\n".join(f"{m:17} {c:6} measured {meas / 2**20:8.1f} MiB  predicted {pred / 2**20:8.1f} MiB "
                       f"({100 * (pred / meas - 1):+.1f}%)" for m, c, meas, pred in rows)
    print(report)
    for plan, checkpoint, measured, predicted in rows:
        assert abs(predicted / measured - 1) <= TOLERANCE, f"{plan}/{checkpoint}\n{report}"
    return {(m, c): meas for m, c, meas, _ in rows}


@pytest.mark.slow
def test_planner_at_depth_short_prompt():
    """P = 1024, R = 64: detach and exact with and without checkpointing; checkpointing lowers exact's peak (about
    2 min of four fresh workers; the default suite checks the planner at this depth against the recorded
    measurement memory-deep-smollm2-2k-all-plans-20261130, tests/planner/test_planner.py)."""
    peaks = _measure(1024, 64, [("detach", "none"), ("detach", "layers"), ("exact", "none"), ("exact", "layers")])
    assert peaks["exact", "layers"] < peaks["exact", "none"]


@pytest.mark.long
def test_planner_at_depth_16k():
    """P = 16,384, R = 128, G = 2 (about an hour on 2 CPU cores): detach and exact with and without checkpointing
    (bench/results/memory-deep-smollm2-16k-replay-plans-20261130.json,
    memory-deep-smollm2-16k-exact-ckpt-20261130.json: -4.4 ... -1.4%)."""
    _measure(16384, 128, [("detach", "none"), ("detach", "layers"), ("exact", "none"), ("exact", "layers")])


@pytest.mark.long
def test_planner_at_depth_16k_standard_checkpointed():
    """The standard plans at P = 16,384 with checkpointing (without it, one 16,512-token sequence through 30
    layers needs ~24 GiB of activations): bench/results/memory-deep-smollm2-16k-standard-ckpt-20261130.json, 28 min
    on 2 idle cores (measured 2648.9 / 4116.9 MiB, predicted -0.4% / +0.1%)."""
    _measure(16384, 128, [("standard", "layers"), ("standard_batched", "layers")])
