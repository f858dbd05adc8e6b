"""`python -m benchmarks prompt|pareto|arch` (and memory) --smoke end to end; the Pareto
flags, architecture discovery and option errors."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import replace

import pytest

from benchmarks.__main__ import main
from benchmarks.pareto import lever_costs, pareto_flags, pareto_grid
from benchmarks.sweeps import (
    PARETO_SMOKE,
    PROMPT_SMOKE,
    ParetoBenchConfig,
    add_pareto_arguments,
    available_archs,
    config_from_args,
)


def _machine_ok(doc):
    for key in ("cpu_model", "cpu_count", "torch", "transformers", "device"):
        assert doc["machine"].get(key) is not None, key


def _cpu_seconds() -> float:
    """CPU time of this process and its finished children (the workers): unlike wall time, not inflated when
    other processes hold the cores."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@pytest.mark.slow
def test_every_benchmark_smoke_runs(tmp_path, capsys):
    t0, c0 = time.perf_counter(), _cpu_seconds()
    docs = {}
    for bench in ("memory", "prompt", "pareto", "arch"):
        out = tmp_path / f"{bench}.json"
        assert main([bench, "--smoke", "--out", str(out)]) == 0, bench
        docs[bench] = json.loads(out.read_text())
        assert (tmp_path / f"{bench}.png").stat().st_size > 1000, bench
        assert str(out) in capsys.readouterr().out
    elapsed, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    # Informational only: a time bound here would depend on the host (benchmarks, not tests, measure time).
    print(f"all four smoke benchmarks: {elapsed:.1f} s wall, {cpu:.1f} s CPU")
    for bench, doc in docs.items():
        assert doc["bench"] == bench
        _machine_ok(doc)
        assert doc["results"] and all(r["status"] == "ok" for r in doc["results"]), bench

    prompt = docs["prompt"]
    assert {(r["plan"], r["prompt_tokens"]) for r in prompt["results"]} == {
        (m, p) for m in PROMPT_SMOKE.plans for p in PROMPT_SMOKE.prompts}
    assert all(r["predicted_step_bytes"] > 0 for r in prompt["results"])
    assert prompt["summary"]["exact"]["largest_within_budget"] == max(PROMPT_SMOKE.prompts)

    pareto = docs["pareto"]
    grid = pareto_grid(PARETO_SMOKE)
    assert [(r["plan"], r["micro_batch"], r["chunk_size"], r["checkpoint"], r["offload_state"],
             r["keep_prompt_graph"]) for r in pareto["results"]] == grid
    # The smoke pulls every lever: both checkpoint settings and an offloaded exact configuration.
    assert {r["checkpoint"] for r in pareto["results"]} == {"none", "layers"}
    assert any(r["offload_state"] and r["plan"] == "exact" for r in pareto["results"])
    kept = [r for r in pareto["results"] if r["keep_prompt_graph"]]
    assert [r["plan"] for r in kept] == ["exact"] and kept[0]["stats"]["keep_prompt_graph"] == 2
    for plan in PARETO_SMOKE.plans:
        assert any(r["pareto"] for r in pareto["results"] if r["plan"] == plan), plan
    assert all(isinstance(r["pareto_all"], bool) for r in pareto["results"])
    assert {(r["micro_batch"], r["chunk_size"]) for r in pareto["results"]} == {
        (k, c) for k in PARETO_SMOKE.micro_batches for c in PARETO_SMOKE.chunk_sizes}
    costs = pareto["lever_costs"]
    assert set(costs["detach"]) == {"checkpoint"}
    assert set(costs["exact"]) == {"checkpoint", "offload", "checkpoint+offload", "keep"}
    for plan, levers in costs.items():
        for lever, cost in levers.items():
            assert cost["pairs"] >= 1, (plan, lever)
            assert math.isfinite(cost["time_ratio"]) and cost["time_ratio"] > 0, (plan, lever)
            # smoke peaks are tiny: a plain peak of 0 leaves no peak ratio, else it is finite
            assert cost["peak_ratio"] is None or math.isfinite(cost["peak_ratio"]), (plan, lever)

    arch = docs["arch"]
    assert {r["arch"] for r in arch["results"]} == set(available_archs())
    assert set(arch["ratios"]) == set(available_archs())


def test_pareto_flags():
    # (memory, time): (1, 5) and (5, 1) and (2, 2) are on the front; (3, 3) is dominated by (2, 2).
    assert pareto_flags([(1, 5), (5, 1), (2, 2), (3, 3)]) == [True, True, True, False]
    assert pareto_flags([(1, 1), (1, 1)]) == [True, True]  # equal points do not dominate each other
    assert pareto_flags([]) == []


def test_pareto_grid_offloads_only_plans_with_a_prompt_state():
    cfg = ParetoBenchConfig(plans=("standard", "exact"), micro_batches=(1,), chunk_sizes=(32,))
    grid = pareto_grid(cfg)
    assert len(grid) == 2 * 2 + 2  # standard: 2 checkpoint settings; exact: 2 x 2 with offloading
    assert not any(off for plan, *_, off, _ in grid if plan == "standard")
    assert {(ck, off) for plan, _, _, ck, off, _ in grid if plan == "exact"} == {
        ("none", False), ("layers", False), ("none", True), ("layers", True)}
    # extra configurations come after the grid, without repeating one of it
    extra = (("exact", 1, 32, "none", True), ("exact", 2, 32, "none", True))
    assert pareto_grid(replace(cfg, extra=extra)) == grid + [("exact", 2, 32, "none", True, 0)]
    # kept capture graphs: a grid of their own for exact only
    keeps = pareto_grid(replace(cfg, keeps=(0, 2)))
    assert {keep for plan, *_, keep in keeps if plan == "exact"} == {0, 2}
    assert {keep for plan, *_, keep in keeps if plan != "exact"} == {0}


def test_lever_costs_are_medians_at_equal_micro_batch_and_chunk():
    def entry(k, ck, off, t, peak, status="ok"):
        return {"plan": "exact", "micro_batch": k, "chunk_size": 32, "checkpoint": ck, "offload_state": off,
                "time_s": t, "peak_bytes": peak, "status": status}

    results = [entry(1, "none", False, 1.0, 100), entry(1, "layers", False, 2.0, 50),
               entry(2, "none", False, 1.0, 200), entry(2, "layers", False, 4.0, 20),
               entry(4, "none", False, 1.0, 100), entry(4, "layers", False, 9.0, 1, status="failed"),
               entry(8, "layers", False, 9.0, 1),  # no plain run at k=8: not a pair
               entry(1, "none", True, 1.5, 0)]
    costs = lever_costs(results)
    assert costs == {"exact": {
        "checkpoint": {"pairs": 2, "time_ratio": 3.0, "peak_ratio": pytest.approx(0.3)},
        "offload": {"pairs": 1, "time_ratio": 1.5, "peak_ratio": 0.0},
    }}
    # a plain peak of 0 gives no peak ratio
    assert lever_costs([entry(1, "none", False, 1.0, 0), entry(1, "layers", False, 2.0, 5)])["exact"][
        "checkpoint"] == {"pairs": 1, "time_ratio": 2.0, "peak_ratio": None}


def _pareto_args(argv):
    parser = argparse.ArgumentParser()
    add_pareto_arguments(parser)
    args = parser.parse_args(argv)
    args.bench = "pareto"
    return args


def _fail(message):
    raise AssertionError(message)


def test_pareto_lever_options():
    default = config_from_args(_pareto_args([]), _fail)
    assert default.checkpoints == ("none", "layers") and default.offloads == (False, True)
    cfg = config_from_args(_pareto_args(["--checkpoint", "layers", "--offload", "yes", "no", "yes"]), _fail)
    assert cfg.checkpoints == ("layers",) and cfg.offloads == (True, False)
    cfg = config_from_args(_pareto_args(["--checkpoint", "none", "--offload", "no"]), _fail)
    assert {(ck, off) for _, _, _, ck, off, _ in pareto_grid(cfg)} == {("none", False)}
    # the smoke profile keeps its offloaded exact configurations only where they fit the grid asked for
    smoke = config_from_args(_pareto_args(["--smoke"]), _fail)
    assert smoke.extra == PARETO_SMOKE.extra and smoke.checkpoints == ("none", "layers")
    assert config_from_args(_pareto_args(["--smoke", "--plans", "detach"]), _fail).extra == ()
    assert config_from_args(_pareto_args(["--smoke", "--checkpoint", "none"]), _fail).extra == (
        ("exact", 1, 32, "none", True), ("exact", 1, 32, "none", False, 2))
    only = config_from_args(_pareto_args(["--smoke", "--offload", "no"]), _fail)
    assert only.extra == () and not any(off for *_, off, _ in pareto_grid(only))
    keeps = config_from_args(_pareto_args(["--keep-prompt-graph", "0", "2", "--plans", "exact"]), _fail)
    assert keeps.keeps == (0, 2) and {keep for *_, keep in pareto_grid(keeps)} == {0, 2}


def test_architectures_come_from_b1_presets(capsys):
    archs = available_archs()
    assert "llama" in archs and "qwen3" in archs
    assert main(["arch", "--list"]) == 0
    listing = capsys.readouterr().out
    assert "llama\tb1-llama" in listing


def test_prompt_sweep_skips_what_the_planner_says_cannot_fit(tmp_path, capsys):
    # A 1 MiB budget: every configuration is predicted over it, so none is run and the bench reports failure.
    out = tmp_path / "p.json"
    assert main(["prompt", "--smoke", "--budget", "1MiB", "--out", str(out)]) == 1
    doc = json.loads(out.read_text())
    assert {r["status"] for r in doc["results"]} == {"skipped"}
    assert all("planner predicts" in r["error"] for r in doc["results"])
    assert {r["prompt_tokens"] for r in doc["results"]} == {min(PROMPT_SMOKE.prompts)}  # stopped after the first P


@pytest.mark.parametrize("argv, message", [
    (["arch", "--archs", "no-such-arch"], "no preset 'b1-no-such-arch'"),
    (["memory", "--arch", "no-such-arch"], "architectures with a B1 preset"),
    (["memory", "--arch", "llama", "--model", "tiny-llama"], "not both"),
    (["prompt", "--budget", "lots"], "cannot read memory size"),
    (["prompt", "--prompts", "1", "8"], "--prompts must all be >= 2"),
    (["pareto", "--plans", "standard"], "invalid choice"),
    (["pareto", "--micro-batches", "0"], "must be >= 1"),
    (["pareto", "--checkpoint", "all"], "invalid choice"),
    (["pareto", "--offload", "true"], "invalid choice"),
])
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_results_directory_default(tmp_path, monkeypatch):
    # Without --out the result lands in bench/results/ under the working directory; a smoke run's in
    # bench/results/smoke/, which git ignores (its numbers are not results).
    monkeypatch.chdir(tmp_path)
    assert main(["pareto", "--smoke", "--micro-batches", "1", "--chunk-sizes", "32",
                 "--plans", "detach"]) == 0
    assert not [f for f in os.listdir(tmp_path / "bench" / "results") if f.endswith(".json")]
    files = os.listdir(tmp_path / "bench" / "results" / "smoke")
    assert any(f.startswith("pareto-") and f.endswith(".json") for f in files)
    assert any(f.endswith(".png") for f in files)
