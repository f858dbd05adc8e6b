"""The planner's `--tp` against `python -m benchmarks cp --tp` (bench/results/cp-tp-b1-llama-4k-20261202.json:
b1-llama, P = 4096, exact, every (C, TP) in {1, 2}^2 as C x TP CPU processes): the prompt state a rank holds within
10% of the measured one, its step memory within 10% of the measured per-rank peak (the bench runs without FSDP:
shard=False), and the measured state at TP = 2 half of TP = 1's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longstraw.planner import PlanInputs, estimate, spec_from_config
from longstraw.planner.spec import load_config

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results" / "cp-tp-b1-llama-4k-20261202.json"


def _rows() -> tuple[dict, list[dict]]:
    document = json.loads(RESULTS.read_text())
    return document["config"], [r for r in document["results"] if r["status"] == "ok"]


def test_measured_state_at_tp2_is_half_of_tp1():
    _, rows = _rows()
    state = {(r["cp"], r["tp"]): r["max_state_bytes"] for r in rows}
    for cp in (1, 2):
        assert abs(state[(cp, 2)] / state[(cp, 1)] - 0.5) <= 0.02


@pytest.mark.parametrize("plan", ["exact", "detach"])
def test_planner_tp_state_within_10_percent_of_measured(plan):
    config, rows = _rows()
    spec = spec_from_config(load_config(config["model"]), config["model"])
    for row in rows:
        inp = PlanInputs(prompt_tokens=config["prompt_tokens"], response_tokens=config["response_tokens"],
                         group_size=config["group_size"], dtype=config["dtype"], chunk_size=config["chunk_size"],
                         gpus=row["cp"] * row["tp"], cp=row["cp"], tp=row["tp"], device="cpu", optimizer="none",
                         shard=False)
        predicted = estimate(spec, inp, plan)
        assert abs(predicted.prompt_state_bytes / row["max_state_bytes"] - 1) <= 0.10, (row, predicted)
        if plan == config["plan"]:  # measured: exact (-1.1%, -5.6%, +8.9%, +3.1% for (C, TP) = 11, 21, 12, 22)
            assert abs(predicted.step_bytes / row["max_peak_bytes"] - 1) <= 0.10, (row, predicted)


def test_planner_refuses_a_tp_that_does_not_divide_the_gpus():
    config, _ = _rows()
    spec = spec_from_config(load_config(config["model"]), config["model"])
    with pytest.raises(ValueError, match="divide the GPUs"):
        estimate(spec, PlanInputs(prompt_tokens=1024, response_tokens=8, group_size=2, gpus=3, tp=2), "exact")
