"""keep_prompt_graph in a prefix tree: each node's capture keeps the graphs of its last N chunks (a node with loss
tokens of its own recomputes them) and its backward uses them instead of a recompute — the same operations, so the
same gradient in float64 as without, and at depth one the same as `backward_group`'s."""

from __future__ import annotations

import pytest
import torch
from helpers import SAME_ORDER_F64, agent_tree, assert_close, grads, random_group, tiny_model

from longstraw import Trajectory, backward_group, backward_tree
from longstraw.engine.tree import plans


def _grad(model: torch.nn.Module, fn, *args, **kwargs) -> tuple[float, torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    result = fn(*args, **kwargs)
    return result.loss, grads(model).clone()


@pytest.mark.parametrize("family", ("llama", "mamba2", "qwen3_next-A"))
def test_kept_graphs_give_the_recomputed_gradient(family, monkeypatch):
    model = tiny_model(family)
    group = random_group(29, [5, 1, 7], seed=2)
    trajectories = [Trajectory(torch.cat([group.prompt, r]), group.prompt.numel(), float(a))
                    for r, a in zip(group.responses, group.advantages)]
    loss, ref = _grad(model, backward_group, model, group, plan="exact", chunk_size=6)
    for keep in (1, 3, 100):
        grp_loss, g_grp = _grad(model, backward_group, model, group, plan="exact", chunk_size=6,
                                keep_prompt_graph=keep)
        tree_loss, g_tree = _grad(model, backward_tree, model, trajectories, plan="exact", chunk_size=6,
                                  keep_prompt_graph=keep)
        assert tree_loss == pytest.approx(loss, rel=1e-12) and grp_loss == pytest.approx(loss, rel=1e-12)
        assert_close(f"group, keep_prompt_graph={keep}", ref, g_grp, SAME_ORDER_F64)
        assert_close(f"depth-one tree, keep_prompt_graph={keep}", ref, g_tree, SAME_ORDER_F64)
    kept = []
    capture = plans.extend_state

    def spy(model, state, ids, chunk_size, leaves=False, keep_graph=0):
        capture(model, state, ids, chunk_size, leaves=leaves, keep_graph=keep_graph)
        kept.append(len(state.graphs))

    monkeypatch.setattr(plans, "extend_state", spy)
    tree_loss, tree_ref = _grad(model, backward_tree, model, agent_tree(), plan="exact", chunk_size=3)
    for keep in (1, 2, 100):
        got_loss, got = _grad(model, backward_tree, model, agent_tree(), plan="exact", chunk_size=3,
                              keep_prompt_graph=keep)
        assert got_loss == pytest.approx(tree_loss, rel=1e-12)
        assert_close(f"agent tree, keep_prompt_graph={keep}", tree_ref, got, SAME_ORDER_F64)
        assert sum(kept) > 0  # the root and the inner nodes without loss tokens kept graphs
        kept.clear()
