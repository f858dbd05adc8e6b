"""A group is a one-level tree: `backward_group` and `backward_tree` on one prompt and its responses (root = the
prompt, one leaf per response) give the same loss, gradient and log-probs as the standard plan, in float64, on every
architecture family of the default suite."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ARCH_FAMILIES,
    EXACT_F64,
    SAME_ORDER_F64,
    assert_close,
    gradient_tolerance,
    grads,
    random_group,
    tiny_model,
)

from longstraw import Trajectory, backward_group, backward_tree


def _run(model: torch.nn.Module, fn, *args, **kwargs):
    """fn(*args, **kwargs) from zero gradients: its result and the gradient it left."""
    for p in model.parameters():
        p.grad = None
    result = fn(*args, **kwargs)
    return result, grads(model).clone()


@pytest.mark.parametrize("family", ARCH_FAMILIES)
def test_group_equals_depth_one_tree_equals_standard(family):
    """G = 3 ragged responses (one of a single token), chunk size 13 (divides neither the prompt nor a response).
    The group's and the tree's exact plans run the same operations (SAME_ORDER_F64); each is the standard plan's
    gradient within the family's kernels' tolerance."""
    model = tiny_model(family)
    group = random_group(37, [5, 1, 9], seed=3)
    trajectories = [Trajectory(torch.cat([group.prompt, r]), group.prompt.numel(), float(a))
                    for r, a in zip(group.responses, group.advantages)]
    std, g_std = _run(model, backward_group, model, group, plan="standard")
    tree_std, g_tree_std = _run(model, backward_tree, model, trajectories, plan="standard")
    grp, g_grp = _run(model, backward_group, model, group, plan="exact", chunk_size=13)
    tree, g_tree = _run(model, backward_tree, model, trajectories, plan="exact", chunk_size=13)
    tol = gradient_tolerance(family)
    same = SAME_ORDER_F64 if tol == EXACT_F64 else tol
    assert_close("standard: tree vs group", g_std, g_tree_std, same)
    assert_close("exact: tree vs group", g_grp, g_tree, same)
    assert_close("exact tree vs standard", g_std, g_tree, tol)
    for value in (tree_std.loss, grp.loss, tree.loss):
        assert value == pytest.approx(std.loss, rel=tol, abs=1e-12)
    for lp_std, lp_grp, lp_tree in zip(std.logprobs, grp.logprobs, tree.logprobs):
        assert_close("log-probs: tree vs standard", lp_std, lp_tree, tol)
        assert_close("log-probs: tree vs group", lp_grp, lp_tree, tol)

