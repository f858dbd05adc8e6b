"""`longstraw bench prompt|pareto|arch` (and memory) --smoke end to end, in under a minute together; the Pareto
flags, architecture discovery and option errors."""

from __future__ import annotations

import json
import os
import time

import pytest

from longstraw.bench.sweeps import PARETO_SMOKE, PROMPT_SMOKE, available_archs, pareto_flags
from longstraw.cli import main


def _machine_ok(doc):
    for key in ("cpu_model", "cpu_count", "torch", "transformers", "device"):
        assert doc["machine"].get(key) is not None, key


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the workers): unlike wall time, not inflated when
    other processes hold the cores."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def test_every_benchmark_smoke_runs_in_under_a_minute(tmp_path, capsys):
    t0, c0 = time.perf_counter(), _cpu_seconds()
    docs = {}
    for bench in ("memory", "prompt", "pareto", "arch"):
        out = tmp_path / f"{bench}.json"
        assert main(["bench", bench, "--smoke", "--out", str(out)]) == 0, bench
        docs[bench] = json.loads(out.read_text())
        assert (tmp_path / f"{bench}.png").stat().st_size > 1000, bench
        assert str(out) in capsys.readouterr().out
    elapsed, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    print(f"all four smoke benchmarks: {elapsed:.1f} s wall, {cpu:.1f} s CPU")
    # On an idle 2-core machine the wall time is ~36 s; on a shared host only CPU time is a fair measure.
    assert cpu < 60, f"the four --smoke benchmarks used {cpu:.0f} s of CPU ({elapsed:.0f} s wall)"
    for bench, doc in docs.items():
        assert doc["bench"] == bench
        _machine_ok(doc)
        assert doc["results"] and all(r["status"] == "ok" for r in doc["results"]), bench

    prompt = docs["prompt"]
    assert {(r["mode"], r["prompt_tokens"]) for r in prompt["results"]} == {
        (m, p) for m in PROMPT_SMOKE.modes for p in PROMPT_SMOKE.prompts}
    assert all(r["predicted_step_bytes"] > 0 for r in prompt["results"])
    assert prompt["summary"]["exact"]["largest_within_budget"] == max(PROMPT_SMOKE.prompts)

    pareto = docs["pareto"]
    assert len(pareto["results"]) == len(PARETO_SMOKE.modes) * len(PARETO_SMOKE.micro_batches) * len(
        PARETO_SMOKE.chunk_sizes)
    for mode in PARETO_SMOKE.modes:
        assert any(r["pareto"] for r in pareto["results"] if r["mode"] == mode), mode
    assert {(r["micro_batch"], r["chunk_size"]) for r in pareto["results"]} == {
        (k, c) for k in PARETO_SMOKE.micro_batches for c in PARETO_SMOKE.chunk_sizes}

    arch = docs["arch"]
    assert {r["arch"] for r in arch["results"]} == set(available_archs())
    assert set(arch["ratios"]) == set(available_archs())


def test_pareto_flags():
    # (memory, time): (1, 5) and (5, 1) and (2, 2) are on the front; (3, 3) is dominated by (2, 2).
    assert pareto_flags([(1, 5), (5, 1), (2, 2), (3, 3)]) == [True, True, True, False]
    assert pareto_flags([(1, 1), (1, 1)]) == [True, True]  # equal points do not dominate each other
    assert pareto_flags([]) == []


def test_architectures_come_from_b1_presets(capsys):
    archs = available_archs()
    assert "llama" in archs and "qwen3" in archs
    assert main(["bench", "arch", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "llama\tb1-llama" in listing


def test_prompt_sweep_skips_what_the_planner_says_cannot_fit(tmp_path, capsys):
    # A 1 MiB budget: every configuration is predicted over it, so none is run and the bench reports failure.
    out = tmp_path / "p.json"
    assert main(["bench", "prompt", "--smoke", "--budget", "1MiB", "--out", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert {r["status"] for r in doc["results"]} == {"skipped"}
    assert all("planner predicts" in r["error"] for r in doc["results"])
    assert {r["prompt_tokens"] for r in doc["results"]} == {min(PROMPT_SMOKE.prompts)}  # stopped after the first P


@pytest.mark.parametrize("argv, message", [
    (["bench", "arch", "--archs", "no-such-arch"], "no preset 'b1-no-such-arch'"),
    (["bench", "memory", "--arch", "no-such-arch"], "architectures with a B1 preset"),
    (["bench", "memory", "--arch", "llama", "--model", "tiny-llama"], "not both"),
    (["bench", "prompt", "--budget", "lots"], "cannot read memory size"),
    (["bench", "prompt", "--prompts", "1", "8"], "--prompts must all be >= 2"),
    (["bench", "pareto", "--modes", "standard"], "invalid choice"),
    (["bench", "pareto", "--micro-batches", "0"], "must be >= 1"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_results_directory_default(tmp_path, monkeypatch):
    # Without --out the result lands in bench/results/ under the working directory.
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "pareto", "--smoke", "--micro-batches", "1", "--chunk-sizes", "32",
                 "--modes", "detach"]) == 0
    files = os.listdir(tmp_path / "bench" / "results")
    assert any(f.startswith("pareto-") and f.endswith(".json") for f in files)
    assert any(f.endswith(".png") for f in files)
