"""bench/gpu.sh's CPU dry run (`--device cpu --smoke`) and the stress-record tool, end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from longstraw.bench import stress

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
    assert {r["mode"] for r in memory["results"]} == {"standard_batched", "standard", "detach", "exact"}
    pareto = json.loads((out / "pareto.json").read_text())
    assert {(r["micro_batch"], r["mode"]) for r in pareto["results"]} == {
        (k, m) for k in (1, 2) for m in ("detach", "exact")}
    assert any(r.get("pareto") for r in pareto["results"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a host without CUDA")
def test_gpu_script_refuses_cuda_without_a_gpu(tmp_path):
    # Without --smoke/--device the script targets cuda and stops before running anything.
    proc = subprocess.run([os.path.join(ROOT, "bench", "gpu.sh"), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 2 and "no CUDA device here" in proc.stderr


def test_stress_records_the_longest_successful_prompt(tmp_path, capsys):
    out = tmp_path / "s.json"
    # 64 runs; --max-prompt stops the doubling before 128.
    assert stress.main(["--model", "tiny-llama-long", "--start", "64", "--max-prompt", "127", "--chunk-size", "32",
                        "--response-tokens", "8", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["prompt_tokens"] for r in doc["results"]] == [64]
    assert doc["record"]["prompt_tokens"] == 64 and doc["record"]["status"] == "ok"
    assert doc["record"]["stats"]["mode"] == "exact" and doc["record"]["stats"]["group_size"] == 4
    # A budget the planner says nothing fits in: skipped before any process starts.
    assert stress.main(["--start", "64", "--budget", "1MiB", "--out", str(tmp_path / "t.json")]) == 1
    (skipped,) = json.loads((tmp_path / "t.json").read_text())["results"]
    assert skipped["status"] == "skipped" and "planner predicts" in skipped["error"]
