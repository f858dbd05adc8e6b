"""`python -m benchmarks threads`: step time, floor share and the worst-scaling ops per torch thread count."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.flops import group_floor, preset_costs
from benchmarks.threads import measure, summarize, table


def _row(plan: str, threads: int, time_s: float, ops: list[list]) -> dict:
    return {"plan": plan, "threads": threads, "time_s": time_s, "times_s": [time_s], "ops": ops}


def test_summary_reads_speedup_share_and_lost_time():
    runs = {1: [_row("standard", 1, 8.0, [["aten::mm", "[[8, 8]]", 6.0, 10]]),
                _row("detach", 1, 2.0, [["aten::mm", "[[8, 8]]", 1.0, 10], ["aten::exp", "[[4]]", 0.2, 5]])],
            2: [_row("standard", 2, 4.0, [["aten::mm", "[[8, 8]]", 3.0, 10]]),
                _row("detach", 2, 1.6, [["aten::mm", "[[8, 8]]", 0.9, 10], ["aten::exp", "[[4]]", 0.1, 5],
                                        ["aten::fill_", "[[2]]", 0.05, 3]])]}
    results = {r["plan"]: r for r in summarize(runs, {"standard": 1.0, "detach": 5.0})}
    detach = results["detach"]
    assert {r["status"] for r in results.values()} == {"ok"}  # what write_results counts as a finished row
    assert detach["time_s"] == {"1": 2.0, "2": 1.6}
    assert detach["speedup"] == pytest.approx(1.25)
    assert detach["floor_share"] == {"1": pytest.approx(0.8), "2": pytest.approx(0.5)}  # 8/2/5, 4/1.6/5
    assert detach["lost_s"] == pytest.approx(0.6)  # 1.6 - 2.0 / 2
    # mm loses 0.9 - 1.0/2; the op seen only at 2 threads loses all of its time; exp loses nothing
    assert [(op[0], round(op[5], 6)) for op in detach["top_lost"]] == [("aten::mm", 0.4), ("aten::fill_", 0.05),
                                                                         ("aten::exp", 0.0)]
    assert results["standard"]["speedup"] == pytest.approx(2.0)
    text = table({"config": {"threads": [1, 2]}, "results": list(results.values())})
    assert "detach" in text and "1.25" in text and "0.50" in text and "mm [[8, 8]]" in text
    assert "fill_ [[2]] - (not run @1: other ops do its work there) 0.050 3 +0.050" in text


def test_floors_of_b1_are_the_memory_bench_ones():
    costs = preset_costs("b1-llama")
    assert group_floor(costs, "detach", 2048, 128, 8) == pytest.approx(5.46, abs=0.01)
    assert group_floor(costs, "exact", 2048, 128, 8) == pytest.approx(3.30, abs=0.01)


@pytest.mark.slow  # ~20 s: two fresh processes, three profiled steps each
def test_one_and_two_threads_on_a_tiny_preset():
    args = argparse.Namespace(model="tiny-llama", prompt_tokens=64, response_tokens=8, groups=2, warm_steps=0,
                              steps=1, plans=["standard", "detach", "exact"])
    runs = {n: measure(n, args) for n in (1, 2)}
    assert [r["threads"] for r in runs[1]] == [1, 1, 1] and [r["threads"] for r in runs[2]] == [2, 2, 2]
    results = summarize(runs, {"standard": 1.0, "detach": 2.0, "exact": 1.5})
    assert [r["plan"] for r in results] == ["standard", "detach", "exact"]
    for r in results:
        assert r["time_s"]["1"] > 0 and r["time_s"]["2"] > 0 and r["top_lost"]
