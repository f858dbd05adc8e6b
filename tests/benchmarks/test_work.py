"""`python -m benchmarks work`: one step's matrix products and attention calls counted from a source tree."""

from __future__ import annotations

import pytest

from benchmarks.work import ROOT, count, table


@pytest.mark.slow  # ~22 s: seven profiled steps in a fresh process
def test_counts_of_this_tree_on_a_tiny_preset():
    rows = {(r["plan"], r["group_size"]): r for r in count(ROOT, "tiny-llama", 64, 8, "32,16,8,2,2")}
    assert set(rows) == {("standard", 2), ("detach", 2), ("exact", 2), ("detach", 16), ("exact", 16),
                         ("tree_exact", 4), ("tree_detach", 4)}
    for r in rows.values():
        assert r["matmuls"] > 0 and r["matmul_flops"] > 0 and r["attention_calls"] > 0
    # exact adds the prompt's reverse backward to detach's replays: more products, at every G
    assert rows["exact", 2]["matmul_flops"] > rows["detach", 2]["matmul_flops"]
    assert rows["detach", 16]["matmul_flops"] > rows["detach", 2]["matmul_flops"]
    doc = {"results": [{"plan": p, "group_size": g, "baseline": r, "this": r, "flops_ratio": 1.0}
                       for (p, g), r in rows.items()]}
    assert "1.0000" in table(doc)
