"""Prefix trees (docs/trees.md): trajectories that share tokens — a system prompt across groups, earlier turns,
branches — encoded once per shared token, with the gradient of every trajectory run on its own.

`build.py` holds the trajectories and their trie, `loss.py` the loss taken a run of positions at a time, `plans.py`
the standard, exact and detach walks, the entry point `backward_tree` is `longstraw.api.tree`'s."""

from longstraw.engine.tree.build import Node, Trajectory, Tree, build_tree

__all__ = ["Node", "Trajectory", "Tree", "build_tree"]
