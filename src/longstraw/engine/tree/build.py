"""Prefix trees of trajectories: `Trajectory` (one sequence with its loss fields), `Node` (a run of tokens shared by
every trajectory below it) and `build_tree` (a radix trie over the trajectories' token ids).

A trajectory is a whole sequence — shared system prompt, task, turns, tool outputs, answer — of N token ids, with
its loss on positions loss_start … N−1. Trajectories that start with the same tokens share those tokens' nodes: each
shared token is encoded once, and its log-prob, when several trajectories score it, is computed once and counted once
per trajectory (with its own advantage, old/reference log-prob and normaliser): the gradient is exactly what running
every trajectory on its own gives (docs/trees.md).

Positions: node n holds the tokens at positions [n.start, n.end). Its forward runs the *input* [n.start−1, n.end−1)
(its parent's last token, then its own tokens but the last) and predicts its own tokens; after it the node's state
holds positions [0, n.end−1), which is what each child's input continues. A node at position 0 (a root) has no
token before it: its input is its tokens but the last, and its first token is not predicted (it is never in a loss)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from functools import cmp_to_key

import numpy as np
import torch

from longstraw.choices import int_at_least
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
    one tree keep their own groups."""

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
        self.advantage = _number("advantage", self.advantage, integer=False)
        if not math.isfinite(self.advantage):
            raise ValueError(f"advantage must be a finite number, got {self.advantage!r}")
        self.group = int(_number("group", self.group, integer=True))
        if self.group < 0:
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


def _number(name: str, value: object, integer: bool) -> float:
    """A Python, NumPy or 0-d tensor real number (an integer where `integer`: not a float) as a float (an int);
    TypeError for anything else, a bool too."""
    kind = "an integer" if integer else "a real number"
    if isinstance(value, torch.Tensor):
        if (value.dim() != 0 or value.dtype == torch.bool or value.is_complex()
                or (integer and value.dtype.is_floating_point)):
            raise TypeError(f"{name} must be {kind} (a Python or NumPy number, or a 0-d tensor), got a {value.dtype} "
                            f"tensor of shape {tuple(value.shape)}: pass one value per trajectory, e.g. {name}.item()")
    elif isinstance(value, (bool, np.bool_)) or not isinstance(
            value, (int, np.integer) if integer else (numbers.Real, np.floating, np.integer)):
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    return int(value) if integer else float(value)  # type: ignore[arg-type]


@dataclass(repr=False)
class Node:
    """Tokens at positions [start, start + len(tokens)), shared by every trajectory in `through`. children: the nodes
    that continue it (each starts at `end`). ending: the trajectories whose last token is this node's last (a leaf's; an
    inner node's when a trajectory is a prefix of others, e.g. successive turns of a chat)."""

    start: int
    tokens: torch.Tensor
    through: list[int]
    children: list[Node] = field(default_factory=list)
    ending: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.tokens.numel()

    def __repr__(self) -> str:  # not the nested dataclass repr, which recurses through the children
        return (f"Node(start={self.start}, end={self.end}, through={len(self.through)} trajectories, "
                f"children={len(self.children)}, ending={self.ending})")

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
        """This node and its descendants, depth first (parents first, siblings in order), stack-based: any depth."""
        out: list[Node] = []
        stack = [self]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children))
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
    def path_end(self) -> int | None:
        """The end of the positions an inner node below the root captures (its input: positions up to its end − 1),
        the furthest of them; None when the root's children are all leaves. A walk's path tensors are this long."""
        return max((n.end - 1 for n in self.nodes() if not n.is_leaf and n is not self.root), default=None)

    @property
    def num_leaves(self) -> int:
        return sum(1 for n in self.nodes() if n.is_leaf)

    @property
    def depth(self) -> int:
        """Nodes on the longest root-to-leaf path, the root counted when it holds tokens."""
        deepest = 0
        stack = [(self.root, 1 if self.root.tokens.numel() else 0)]
        while stack:
            node, depth = stack.pop()
            deepest = max(deepest, depth)
            stack.extend((c, depth + (1 if c.tokens.numel() else 0)) for c in node.children)
        return deepest

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
    int_at_least("min_shared", min_shared, 1)
    ids = [t.ids.detach().to("cpu", torch.long) for t in trajectories]
    root = _trie(ids)
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


def _trie(ids: list[torch.Tensor]) -> Node:
    """The radix trie of `ids` without recursion, from their lexicographic order: trajectories that share a prefix
    are adjacent in it, so each node holds a contiguous run of that order (its `through`), and the common prefix of
    two neighbours (their LCP) says where the second leaves the first's path. One pass over the order keeps the path
    of open nodes (a stack): a neighbour sharing l tokens closes the nodes starting at or after l, splits the one
    that l falls inside, and opens its own node from l. A tensor comparison per pair of neighbours (and per
    comparison of the sort); a node's `through` and `ending` are in index order, its children ordered by their first
    trajectory, as a top-down split by each trajectory's next token orders them."""
    def by_ids(a: int, b: int) -> int:
        return _compare(ids[a], ids[b])

    order = sorted(range(len(ids)), key=cmp_to_key(by_ids))
    # node k: starts[k], ends[k], the run order[los[k]:his[k]], children[k]; node 0 is a virtual root [0, 0)
    starts, ends, los, his = [0], [0], [0], [len(ids)]
    children: list[list[int]] = [[]]
    path = [0]

    def open_node(start: int, end: int, lo: int, parent: int) -> int:
        starts.append(start)
        ends.append(end)
        los.append(lo)
        his.append(len(ids))
        children.append([])
        children[parent].append(len(starts) - 1)
        path.append(len(starts) - 1)
        return len(starts) - 1

    previous: torch.Tensor | None = None
    for j, i in enumerate(order):
        current = ids[i]
        shared = 0 if previous is None else _common(previous, current)
        while len(path) > 1 and starts[path[-1]] >= shared:
            his[path.pop()] = j
        top = path[-1]
        if shared < ends[top]:  # the new trajectory leaves `top` inside it: split it at `shared`
            parent = path[-2]
            path.pop()
            upper = open_node(starts[top], shared, los[top], parent)
            children[parent].remove(top)
            children[upper].append(top)
            starts[top], his[top] = shared, j
            top = upper
        if current.numel() > shared:
            open_node(shared, current.numel(), j, top)
        previous = current
    nodes = [Node(start=starts[k], tokens=ids[order[los[k]]][starts[k]:ends[k]].clone(),
                  through=sorted(order[los[k]:his[k]])) for k in range(len(starts))]
    for k, node in enumerate(nodes):
        node.ending = [i for i in node.through if ids[i].numel() == ends[k]] if k else []
        node.children = sorted((nodes[c] for c in children[k]), key=lambda c: c.through[0])
    root = nodes[0]
    return root.children[0] if len(root.children) == 1 else root


def _compare(a: torch.Tensor, b: torch.Tensor) -> int:
    """-1, 0 or 1: `a` before, equal to or after `b` in lexicographic order (a prefix first)."""
    n = _common(a, b)
    if n < min(a.numel(), b.numel()):
        return -1 if int(a[n]) < int(b[n]) else 1
    return (a.numel() > b.numel()) - (a.numel() < b.numel())


def _common(a: torch.Tensor, b: torch.Tensor) -> int:
    """The length of the common prefix of `a` and `b`."""
    n = min(a.numel(), b.numel())
    differs = (a[:n] != b[:n]).nonzero()
    return n if differs.numel() == 0 else int(differs[0])


def _merge_short(node: Node, min_shared: int) -> list[Node]:
    """`node`'s subtree with every node shorter than `min_shared` pushed into its branches: the nodes that replace
    `node`. A node is kept when it is long enough or has no children, and its children are replaced in turn; a
    shorter one is dissolved: its tokens go in front of each child's, whose replacements take its place, followed by
    a node of its own tokens for the trajectories that end there. An explicit stack of frames [node, its children,
    the next child's index, the replacements so far, kept], so a tree of any depth is merged."""
    def enter(n: Node) -> list:
        return [n, list(n.children), 0, [], n.tokens.numel() >= min_shared or n.is_leaf]

    stack = [enter(node)]
    while True:
        frame = stack[-1]
        current, children, k, out, kept = frame
        if k < len(children):
            child = children[k]
            frame[2] = k + 1
            if not kept:
                child.tokens = torch.cat([current.tokens, child.tokens])
                child.start = current.start
            stack.append(enter(child))
            continue
        stack.pop()
        if kept:
            current.children = out
            value = [current]
        else:
            value = out + ([Node(start=current.start, tokens=current.tokens, through=list(current.ending),
                                 ending=list(current.ending))] if current.ending else [])
        if not stack:
            return value
        stack[-1][3].extend(value)
