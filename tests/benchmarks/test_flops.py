"""The FLOP-count floor (`benchmarks/flops.py`): the per-token costs from a config, the group formulas at Bench
B1's shape, and the tree count agreeing with the group count on a one-level tree."""

from __future__ import annotations

import pytest

from benchmarks.flops import Costs, costs, group_floor, group_flops, preset_costs, tree_flops
from benchmarks.tree_batch import make_trajectories
from longstraw.models.presets import PRESETS
from longstraw.planner.tree import TreeShape


def test_the_costs_of_b1_llama():
    c = preset_costs("b1-llama")  # 4 layers, d 256, 8 heads of 32, 2 KV heads, MLP 704, vocab 32000
    per_layer = 256 * 256 * 2 + 256 * 64 * 2 + 3 * 256 * 704
    assert c == Costs(linear=2 * 4 * per_layer, pair=4 * 8 * 32 * 4, head=2 * 32000 * 256)
    assert c.body(3, 5) == c.linear * 3 + c.pair * (3 * 5 + 6)
    assert costs(PRESETS["b1-qwen3-next"]()) is None and preset_costs("some/directory") is None


def test_the_group_floors_at_b1():
    c = preset_costs("b1-llama")
    # P 2048, R 128, G 8: standard / detach 5.46x and standard / exact 3.30x
    assert group_floor(c, "detach", 2048, 128, 8) == pytest.approx(5.458, abs=1e-3)
    assert group_floor(c, "exact", 2048, 128, 8) == pytest.approx(3.304, abs=1e-3)
    # exact runs the prompt 3 more times than detach, and its replies' pairs with the prompt state a third pass (dK,
    # dV): detach's state is a constant
    prompt = c.body(2047)
    pairs = 8 * c.pair * 128 * 2047
    assert group_flops(c, "exact", 2048, 128, 8) - group_flops(c, "detach", 2048, 128, 8) == 3 * prompt + pairs
    with pytest.raises(ValueError, match="no FLOP count for plan"):
        group_flops(c, "packed", 8, 4, 2)


def test_a_one_level_tree_counts_as_its_group():
    c = Costs(linear=7, pair=3, head=11)
    shape = TreeShape(system_tokens=9, tasks=1, task_tokens=4, group_size=4, turns=1, response_tokens=5, branching=4)
    trajectories = make_trajectories(shape, 64, seed=0)
    prompt, response = shape.prompt_tokens, shape.turn_tokens
    assert tree_flops(c, "tree_exact", trajectories) == group_flops(c, "exact", prompt, response, 4)
    assert tree_flops(c, "tree_detach", trajectories) == group_flops(c, "detach", prompt, response, 4)
    assert tree_flops(c, "group", trajectories) == group_flops(c, "exact", prompt, response, 4)
    assert tree_flops(c, "flattened", trajectories) == group_flops(c, "standard", prompt, response, 4)


def test_the_peers_counts():
    from benchmarks.peers import SHAPES, configurations, flops_over_exact

    over = flops_over_exact(SHAPES["b1"], configurations(8))
    c = preset_costs("b1-llama")
    assert over["longstraw-exact"] == 1.0
    assert over["trl-b8"] == over["trl-b1x8"] == pytest.approx(group_floor(c, "exact", 4096, 256, 8))
    assert over["longstraw-exact-keep"] == over["prefix-grouper"] < 1.0  # the prompt once with grad, no recompute
    assert over["longstraw-detach"] < over["prefix-grouper"] < over["prefix-grouper-ckpt"]
    assert over["trl-b8-ckpt"] > over["trl-b8"]
    assert flops_over_exact(SHAPES["smoke"], configurations(4))["trl-b4"] > 1.0
