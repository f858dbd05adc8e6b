"""`longstraw.plan`: every property of every plan, the name lookup and its refusals."""

from __future__ import annotations

import subprocess
import sys

import pytest

from longstraw import choices
from longstraw.plan import PLANS, PLANS_BASELINE_FIRST, Plan, plan_named

EXPECTED = {
    # name: (captures_state, exact_gradient, needs_chunk_boundaries, batched, context_parallel, tensor_parallel,
    #        offload, kept_graphs, peak_key)
    "standard": (False, True, False, False, False, True, False, False, "sdpa"),
    "standard_batched": (False, True, False, True, False, True, False, False, "sdpa"),
    "detach": (True, False, False, False, True, True, True, False, "replay"),
    "exact": (True, True, True, False, True, True, True, True, "replay"),
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_properties(name: str) -> None:
    plan = plan_named(name)
    got = (plan.captures_state, plan.exact_gradient, plan.needs_chunk_boundaries, plan.batched,
           plan.supports_context_parallel, plan.supports_tensor_parallel, plan.supports_offload,
           plan.supports_kept_graphs, plan.peak_key)
    assert got == EXPECTED[name]
    assert plan.name == name and str(plan) == name
    assert plan.description and "\n" not in plan.description


def test_tables_and_choices() -> None:
    assert list(PLANS) == list(EXPECTED)
    assert choices.PLANS == tuple(EXPECTED)
    assert [p.name for p in PLANS_BASELINE_FIRST] == ["standard_batched", "standard", "detach", "exact"]
    assert choices.PLANS_BASELINE_FIRST == ("standard_batched", "standard", "detach", "exact")


def test_equality_and_hash() -> None:
    assert plan_named("exact") == PLANS["exact"]
    assert plan_named("exact") != PLANS["detach"]
    assert len({plan_named("exact"), PLANS["exact"], PLANS["detach"]}) == 2
    assert plan_named(PLANS["detach"]) is PLANS["detach"]
    with pytest.raises(TypeError, match="compare a Plan's properties or Plan values, not names"):
        _ = PLANS["exact"] == "exact"
    with pytest.raises(TypeError, match="not names"):
        _ = "exact" in (PLANS["detach"], PLANS["exact"])
    with pytest.raises(AttributeError):
        PLANS["exact"].name = "detach"  # type: ignore[misc]
    assert isinstance(PLANS["exact"], Plan)


def test_unknown_name() -> None:
    with pytest.raises(ValueError, match="standard, standard_batched, detach, exact.*did you mean exact"):
        plan_named("exakt")
    with pytest.raises(ValueError, match="unknown plan 'nope'"):
        plan_named("nope")


def test_imports_nothing_heavy() -> None:
    code = "import sys, longstraw.plan, longstraw.choices; assert 'torch' not in sys.modules, 'torch loaded'"
    subprocess.run([sys.executable, "-c", code], check=True)
