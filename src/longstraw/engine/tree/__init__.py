"""Prefix trees (docs/trees.md): trajectories that share tokens — a system prompt across groups, earlier turns,
branches — encoded once per shared token, with the gradient of every trajectory run on its own."""

from longstraw.engine.tree.build import Node, Trajectory, Tree, build_tree

__all__ = ["Node", "Trajectory", "Tree", "build_tree"]
