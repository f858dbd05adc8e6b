"""bench/gpu.sh's CPU dry run (`--device cpu --smoke`) and the stress-record tool, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_gpu_script_dry_run_on_cpu(tmp_path):
    out = tmp_path / "gpu"
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run([os.path.join(ROOT, "bench", "gpu.sh"), str(out), "--device", "cpu", "--smoke"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["machine"]["device"] == "cpu" and summary["device_memory_bytes"] is None
    assert summary["checks"] and all(c["status"] == "ok" for c in summary["checks"]), summary["checks"]
    assert all(c["predicted_step_bytes"] > 0 for c in summary["checks"])
    memory = json.loads((out / "memory-P64.json").read_text())
    assert {r["plan"] for r in memory["results"]} == {"standard_batched", "standard", "detach", "exact"}
    pareto = json.loads((out / "pareto.json").read_text())
    assert {(r["micro_batch"], r["plan"]) for r in pareto["results"]} == {
        (k, m) for k in (1, 2) for m in ("detach", "exact")}
    assert any(r.get("pareto") for r in pareto["results"])
    longest = json.loads((out / "longest-exact.json").read_text())
    assert [a["prompt_tokens"] for a in longest["attempts"]] == [128, 256]
    assert longest["record"]["prompt_tokens"] == 256 and longest["record"]["plan"] == "exact"
    decode = json.loads((out / "decode.json").read_text())
    assert [r["prompt_tokens"] for r in decode["results"]] == [64] and summary["decode"]["status"] == "ok"
    md = (out / "summary.md").read_text()
    for heading in ("## B1 at P = 64", "## Longest exact step", "## Sampling throughput", "time exact / detach"):
        assert heading in md


def _b1_entry(plan, g, status="ok", peak=None, predicted=None, time_s=1.0):
    return {"plan": plan, "group_size": g, "status": status, "peak_bytes": peak, "predicted_step_bytes": predicted,
            "time_s": time_s}


def test_gpu_summary_marks_targets_met_or_not():
    """summary.md: the GPU targets from measured ratios, and from the planner's forecast only where
    standard_batched was skipped (beyond the device), never from a peak below resolution."""
    from benchmarks.gpu import markdown
    from benchmarks.memory import compute_ratios

    gib = 2**30
    results = [_b1_entry("standard_batched", g, "skipped", predicted=500 * gib) for g in (2, 8)]
    results += [_b1_entry("standard", g, time_s=60.0, peak=80 * gib) for g in (2, 8)]
    results += [_b1_entry("detach", g, peak=p * gib, time_s=10.0) for g, p in ((2, 12), (8, 12.3))]
    results += [_b1_entry("exact", g, peak=p * gib, time_s=18.0) for g, p in ((2, 35), (8, 40))]
    summary = {"machine": {"gpu_name": "NVIDIA H200", "torch": "x"}, "started": "now", "wall_s": 1.0,
               "config": {"model": "gpu-llama-1b", "dtype": "bfloat16", "device": "cuda", "response_tokens": 512},
               "b1": {"131072": {"results": results, "ratios": compute_ratios(results)}}}
    md = markdown(summary)
    assert "# bench/gpu.sh on NVIDIA H200" in md
    assert "detach >= 8x less peak than standard_batched: 40.65x (met from the planner's forecast" in md
    assert "exact >= 6x less peak than standard_batched: 12.50x (met from the planner's forecast" in md
    assert "time standard / detach >= 5x: 6.00x (met)" in md
    assert "time exact / detach <= 1.5x: 1.80x (NOT met)" in md
    assert "detach peak flat in G (<= 5%): +2.5% (G 2 -> 8) (met)" in md
    assert "exact peak flat in G (<= 5%): +14.3% (G 2 -> 8) (NOT met)" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_gpu_script_refuses_cuda_without_a_gpu(tmp_path):
    # Without --smoke/--device the script targets cuda and stops before running anything.
    proc = subprocess.run([os.path.join(ROOT, "bench", "gpu.sh"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 2 and "no CUDA device here" in proc.stderr


def test_stress_records_the_longest_successful_prompt(tmp_path, capsys):
    out = tmp_path / "s.json"
    # 64 runs; --max-prompt stops the doubling before 128.
    assert main(["stress", "--model", "tiny-llama-long", "--start", "64", "--max-prompt", "127", "--chunk-size", "32",
                        "--response-tokens", "8", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["prompt_tokens"] for r in doc["results"]] == [64]
    assert doc["record"]["prompt_tokens"] == 64 and doc["record"]["status"] == "ok"
    assert doc["record"]["stats"]["plan"] == "exact" and doc["record"]["stats"]["group_size"] == 4
    # A budget the planner says nothing fits in: skipped before any process starts.
    assert main(["stress", "--start", "64", "--budget", "1MiB", "--out", str(tmp_path / "t.json")]) == 1
    (skipped,) = json.loads((tmp_path / "t.json").read_text())["results"]
    assert skipped["status"] == "skipped" and "planner predicts" in skipped["error"]
