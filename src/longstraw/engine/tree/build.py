"""Prefix trees of trajectories: `Trajectory` (one sequence with its loss fields), `Node` (a run of tokens shared by
every trajectory below it) and `build_tree` (a radix trie over the trajectories' token ids).

A trajectory is a whole sequence — shared system prompt, task, turns, tool outputs, answer — of N token ids, with
its loss on positions loss_start … N−1 (the token at position t is scored by the model's prediction from positions
< t). Trajectories that start with the same tokens share those tokens' nodes: each shared token is encoded once, and
its log-prob, when several trajectories score it, is computed once and counted once per trajectory (with each
trajectory's own advantage, old/reference log-prob and normaliser): the gradient is the sum over trajectories,
exactly what running every trajectory on its own gives (docs/trees.md).

Positions: node n holds the tokens at positions [n.start, n.end). Its forward runs the *input* [n.start−1, n.end−1)
(its parent's last token, then its own tokens but the last) and predicts its own tokens; after it the node's state
holds positions [0, n.end−1), which is what each child's input continues. A node at position 0 (a root) has no
token before it: its input is its tokens but the last, and its first token is not predicted (it is never in a loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longstraw.engine.group import Group, _check_float, _check_ids


@dataclass
class Trajectory:
    """One sequence of a batch with its loss fields.

    ids (N,): every token. loss_start: the first position in the loss (1 ≤ loss_start < N; the tokens before it are
    context: prompt, system prompt, earlier turns that another trajectory scores). advantage: this trajectory's A.
    loss_mask (N − loss_start,) bool: True where the token is the policy's action (tool outputs and observations
    False: context, no loss), at least one True; None: every token from loss_start. old_logprobs / ref_logprobs
    (N − loss_start,): the sampling policy's and the reference model's log-probs of those tokens. group: which group's
    normalisers the trajectory counts in (GRPO's 1/G and 1/|o_i|, dapo's Σ|o|): trajectories of different tasks in
    one tree keep their own groups.
    """

    ids: torch.Tensor
    loss_start: int
    advantage: float
    loss_mask: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    group: int = 0

    def __post_init__(self) -> None:
        _check_ids("ids", self.ids)
        n = self.ids.numel()
        if isinstance(self.loss_start, bool) or not isinstance(self.loss_start, int) or not 1 <= self.loss_start < n:
            raise ValueError(f"loss_start must be an integer in [1, {n - 1}] for a trajectory of {n} tokens (the "
                             f"first token is never predicted, and at least one token is in the loss), got "
                             f"{self.loss_start!r}")
        if isinstance(self.advantage, torch.Tensor):
            self.advantage = float(self.advantage)
        if isinstance(self.advantage, bool) or not isinstance(self.advantage, (int, float)) or \
                not torch.isfinite(torch.tensor(float(self.advantage))):
            raise ValueError(f"advantage must be a finite number, got {self.advantage!r}")
        self.advantage = float(self.advantage)
        if isinstance(self.group, bool) or not isinstance(self.group, int) or self.group < 0:
            raise ValueError(f"group must be an integer >= 0, got {self.group!r}")
        r = n - self.loss_start
        if self.loss_mask is not None:
            m = self.loss_mask
            if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or tuple(m.shape) != (r,):
                raise ValueError(f"loss_mask must be a torch.bool tensor of shape ({r},) (one per token from "
                                 f"loss_start), got {m.dtype if isinstance(m, torch.Tensor) else type(m).__name__} "
                                 f"{tuple(m.shape) if isinstance(m, torch.Tensor) else ''}")
            if not bool(m.any()):
                raise ValueError("loss_mask masks every token: a trajectory needs at least one token in the loss")
        for name in ("old_logprobs", "ref_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_float(name, value, (r,), self.loss_mask)
                if (value[self.in_loss()] > 0).any():
                    raise ValueError(f"{name} has positive values: log-probs must be <= 0")

    @property
    def length(self) -> int:
        return self.ids.numel()

    def in_loss(self) -> torch.Tensor:
        """(N − loss_start,) bool: the tokens of the loss."""
        if self.loss_mask is not None:
            return self.loss_mask
        return torch.ones(self.length - self.loss_start, dtype=torch.bool)

    @property
    def loss_tokens(self) -> int:
        """|o_i|: tokens in the loss."""
        return int(self.in_loss().sum())


@dataclass
class Node:
    """Tokens at positions [start, start + len(tokens)), shared by every trajectory in `through`.

    children: the nodes that continue it (each starts at `end`). ending: the trajectories whose last token is this
    node's last (a leaf's trajectories; an inner node's when a trajectory is a prefix of others, as successive turns
    of one conversation are)."""

    start: int
    tokens: torch.Tensor
    through: list[int]
    children: list[Node] = field(default_factory=list)
    ending: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.tokens.numel()

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def input_ids(self, parent_last: torch.Tensor | None) -> torch.Tensor:
        """The node's forward input (module docstring): (n,) from position start − 1, or (n − 1,) at position 0."""
        if self.start == 0:
            return self.tokens[:-1]
        assert parent_last is not None
        return torch.cat([parent_last.reshape(1), self.tokens[:-1]])

    @property
    def input_start(self) -> int:
        return max(self.start - 1, 0)

    def walk(self) -> list[Node]:
        """This node and its descendants, depth first (parents before children)."""
        out = [self]
        for child in self.children:
            out.extend(child.walk())
        return out


@dataclass
class Tree:
    """The trajectories and their trie. `root` starts at position 0; it holds the tokens every trajectory shares, and
    may hold none (trajectories that differ from their first token), in which case its children are independent
    trees. `min_shared`: the shortest node `build_tree` split off (docs/trees.md)."""

    trajectories: list[Trajectory]
    root: Node
    min_shared: int = 1

    def nodes(self) -> list[Node]:
        return self.root.walk()

    @property
    def num_leaves(self) -> int:
        return sum(1 for n in self.nodes() if n.is_leaf)

    @property
    def depth(self) -> int:
        """Nodes on the longest root-to-leaf path, the root counted when it holds tokens."""
        def depth_of(node: Node) -> int:
            return (1 if node.tokens.numel() else 0) + max((depth_of(c) for c in node.children), default=0)
        return depth_of(self.root)

    @property
    def tokens_encoded(self) -> int:
        """Token positions the model runs once over the tree: every node's input."""
        return sum(max(n.tokens.numel() - (1 if n.start == 0 else 0), 0) for n in self.nodes())

    @property
    def tokens_flattened(self) -> int:
        """Token positions running every trajectory on its own runs: Σ (N_i − 1)."""
        return sum(t.length - 1 for t in self.trajectories)

    def stats(self) -> dict[str, int]:
        nodes = self.nodes()
        return {"tree_nodes": sum(1 for n in nodes if n.tokens.numel()), "tree_leaves": self.num_leaves,
                "tree_depth": self.depth, "trajectories": len(self.trajectories),
                "tokens_encoded": self.tokens_encoded, "tokens_flattened": self.tokens_flattened}


def build_tree(trajectories: list[Trajectory], min_shared: int = 1) -> Tree:
    """The radix trie of `trajectories`' ids: one node per maximal run of tokens that the same set of trajectories
    holds. A node shorter than `min_shared` tokens (but the root) is not split off: each of its branches holds those
    tokens itself (they are then encoded once per branch), which keeps very short shared runs from costing a node
    each (one more chunk forward and state) for nothing."""
    if not isinstance(trajectories, (list, tuple)) or not trajectories:
        raise ValueError("a tree needs a non-empty list of Trajectory")
    for i, t in enumerate(trajectories):
        if not isinstance(t, Trajectory):
            raise TypeError(f"trajectories[{i}] must be a longstraw Trajectory, got {type(t).__name__}")
    if isinstance(min_shared, bool) or not isinstance(min_shared, int) or min_shared < 1:
        raise ValueError(f"min_shared must be an integer >= 1, got {min_shared!r}")
    ids = [t.ids.detach().to("cpu", torch.long) for t in trajectories]
    root = _split(ids, list(range(len(ids))), 0)
    if min_shared > 1:
        root.children = [c for child in root.children for c in _merge_short(child, min_shared)]
    return Tree(trajectories=list(trajectories), root=root, min_shared=min_shared)


def group_tree(group: Group) -> Tree:
    """A group as a one-level tree: the prompt (P,) the root, response i (R_i,) the leaf of trajectory i (loss from
    position P), whatever tokens the responses share."""
    p, g = group.prompt.numel(), group.size
    trajectories = [Trajectory(
        ids=torch.cat([group.prompt, r.to(group.prompt.device)]), loss_start=p, advantage=float(group.advantages[i]),
        loss_mask=None if group.loss_masks is None else group.loss_masks[i],
        old_logprobs=None if group.old_logprobs is None else group.old_logprobs[i],
        ref_logprobs=None if group.ref_logprobs is None else group.ref_logprobs[i])
        for i, r in enumerate(group.responses)]
    root = Node(start=0, tokens=group.prompt.clone(), through=list(range(g)))
    root.children = [Node(start=p, tokens=r.clone(), through=[i], ending=[i]) for i, r in enumerate(group.responses)]
    return Tree(trajectories=trajectories, root=root, min_shared=2)


def _split(ids: list[torch.Tensor], members: list[int], start: int) -> Node:
    """The node at `start` that `members` (trajectory indices, all equal on [0, start)) share, and its subtree."""
    lengths = [ids[i].numel() for i in members]
    shortest = min(lengths)
    first = ids[members[0]]
    end = start
    # the longest run from `start` on which every member agrees (a member that ends stops the run)
    if len(members) > 1:
        stack = torch.stack([ids[i][start:shortest] for i in members])  # (M, shortest − start)
        agree = (stack == stack[:1]).all(0)
        differs = (~agree).nonzero()
        end = shortest if differs.numel() == 0 else start + int(differs[0])
    else:
        end = shortest
    node = Node(start=start, tokens=first[start:end].clone(), through=list(members))
    node.ending = [i for i in members if ids[i].numel() == end]
    rest = [i for i in members if ids[i].numel() > end]
    by_token: dict[int, list[int]] = {}
    for i in rest:
        by_token.setdefault(int(ids[i][end]), []).append(i)
    node.children = [_split(ids, group, end) for group in by_token.values()]
    return node


def _merge_short(node: Node, min_shared: int) -> list[Node]:
    """`node`'s subtree with every node shorter than `min_shared` pushed into its branches."""
    if node.tokens.numel() >= min_shared or (not node.children and not node.ending):
        node.children = [c for child in node.children for c in _merge_short(child, min_shared)]
        return [node]
    if node.is_leaf:  # a leaf is never split off: it has nothing below to share with
        return [node]
    out: list[Node] = []
    for child in node.children:
        child.tokens = torch.cat([node.tokens, child.tokens])
        child.start = node.start
        out.extend(_merge_short(child, min_shared))
    if node.ending:
        out.append(Node(start=node.start, tokens=node.tokens, through=list(node.ending), ending=list(node.ending)))
    return out
