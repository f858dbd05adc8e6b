"""Prefix trees (docs/trees.md): trajectories that share tokens — a system prompt across groups, earlier turns,
branches — encoded once per shared token, with the gradient of every trajectory run on its own.

`build.py` holds the trajectories and their trie, `loss.py` the loss taken a run of positions at a time, `plans.py`
the standard, exact and detach walks, `api.py` the entry point `backward_tree`."""

from longstraw.engine.tree.build import Node, Trajectory, Tree, build_tree

__all__ = ["Node", "Trajectory", "Tree", "TreeResult", "backward_tree", "build_tree"]


def __getattr__(name: str):
    # api imports the group engine (engine.api), which is heavier than the data model: loaded on first use.
    if name in ("backward_tree", "TreeResult"):
        import longstraw.engine.tree.api

        return getattr(longstraw.engine.tree.api, name)
    raise AttributeError(f"module 'longstraw.engine.tree' has no attribute {name!r}")
