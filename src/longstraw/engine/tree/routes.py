"""The router load-balancing term (`engine/router.py`) over a prefix tree: per-token router weights, the counting pass.

transformers' aux loss over a batch counts every token of every sequence: a tree position that k trajectories hold
counts k times. The walk runs each position once, so each run carries that multiplicity as its weight:

* a node's input positions after its first (its own tokens but the last): |through(node)|;
* a node's first input position, its parent's last token, which each child's forward runs again: |through(child)|, and
  the first child also carries the parent's trajectories that end there (`parent.ending`: their last token is run by no
  other forward; its routers see the same prefix and token in any child's forward, so their logits are the same);
* a leaf's replay runs all its tokens, the last too (the batch's forward routes it): |through(leaf)| each.

A packed forward of the tree (TRL's `AsyncGRPOTrainer` runs its rows as one prefix trie, `count="packed"`) routes
each trie position once, a trie node being a token together with its next token (or the sequence's end): every run
weighs 1, except where a walk runs one trie position several times, whose runs share its 1. That is a node's first
input position (its parent's last token) in each of the siblings that continue it with the same token (all of them
when a node shorter than the tree's `min_shared` went into its branches), a short run of tokens such siblings share,
and the parent's ending trajectories, whose trie position the first child's forward carries.

The counts need every token's top-k before the first backward: `count_routes` walks the tree once without grad, and
sums the weighted probabilities too, so the loss's value (`aux_value`) covers every token whatever the plan."""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field

import torch

from longstraw.engine.hf.segment import run_segment
from longstraw.engine.pad import pad
from longstraw.engine.router import RouterAux, RouterCounts, RouterTap, count, top_k
from longstraw.engine.state.capture import chunk_bounds, keep_owned
from longstraw.engine.state.prompt import Collected, PromptState
from longstraw.engine.tree.build import Node, Tree


@dataclass
class RouteWeights:
    """Each node's weights by id(node) (`router_weights`): its first input position's, its other positions', and
    overrides of the latter at some of its own tokens {offset j in node.tokens: weight}."""

    weights: dict[int, tuple[float, float, dict[int, float]]] = field(default_factory=dict)

    def positions(self, node: Node, start: int, end: int) -> torch.Tensor:
        """Weights (end − start,) of `node`'s forward over input positions [start, end)."""
        first, rest, own = self.weights[id(node)]
        w = torch.full((end - start,), rest, dtype=torch.float64)
        if node.start > 0 and start == node.input_start:
            w[0] = first
        for j, value in own.items():
            if start <= node.start + j < end:
                w[node.start + j - start] = value
        return w

    def leaves(self, leaves: list[Node], mask: torch.Tensor) -> torch.Tensor:
        """Weights (k, T) of sibling leaves' routed replays [parent's last token] + tokens; mask (k, T) real tokens."""
        w = mask.to(torch.float64)
        for row, leaf in enumerate(leaves):
            first, rest, own = self.weights[id(leaf)]
            w[row] *= rest
            shift = int(leaf.start > 0)
            if shift:
                w[row, 0] = first
            for j, value in own.items():
                w[row, j + shift] = value
        return w


@dataclass
class TreeRouter:
    """The term of one walk: `aux` (counts, gradient weights, tap) and the weights of each forward's tokens."""

    aux: RouterAux
    weights: RouteWeights


def router_weights(tree: Tree, count: str = "sequences") -> RouteWeights:
    """The weights the module docstring gives: `count` "sequences" (transformers' forward of the batch's sequences)
    or "packed" (one forward of the tree's trie)."""
    out: dict[int, tuple[float, float, dict[int, float]]] = {}
    root = tree.root
    out[id(root)] = (1.0, 1.0, {}) if count == "packed" else (float(len(root.through)), float(len(root.through)), {})
    for node in tree.nodes():
        ending = 1 if node.ending else 0
        for k, child in enumerate(node.children):
            if count == "packed":
                out[id(child)] = (1 / _sharing(node.children, child, 1) + (ending if k == 0 else 0), 1.0,
                                  _shared_runs(node.children, child))
            else:
                extra = len(node.ending) if k == 0 else 0
                out[id(child)] = (float(len(child.through) + extra), float(len(child.through)), {})
    return RouteWeights(out)


def _sharing(siblings: list[Node], node: Node, n: int) -> int:
    """How many of `siblings` (`node` among them) begin with node's first n tokens."""
    head = node.tokens[:n]
    return sum(1 for s in siblings if s.tokens.numel() >= n and torch.equal(s.tokens[:n], head))


def _shared_runs(siblings: list[Node], node: Node) -> dict[int, float]:
    """{j: 1 / k} for node's own tokens j but its last whose trie position (tokens[:j + 2]) k > 1 siblings run."""
    out: dict[int, float] = {}
    for j in range(node.tokens.numel() - 1):
        k = _sharing(siblings, node, j + 2)
        if k == 1:
            break
        out[j] = 1 / k
    return out


def check_routable(tree: Tree) -> None:
    """A walk routes a leaf's last token only by replaying it: a root with no children (identical trajectories) is
    visited as a node, whose last token no forward runs."""
    if tree.root.is_leaf:
        raise ValueError("router_aux_coef > 0 on a tree whose trajectories are all the same sequence: its last token "
                         "runs in no forward; pass the trajectory once, or set router_aux_coef=0")


def count_routes(model: torch.nn.Module, tree: Tree, state: PromptState, weights: RouteWeights, chunk_size: int,
                 micro_batch: int) -> tuple[RouterCounts, torch.Tensor]:
    """The tree's top-k router counts and Σ weight · softmax(router logits) (E,) float32, each token weighted as the
    module docstring says, through the chunks (`chunk_size`) and sibling leaves (`micro_batch` at once) the walk
    runs; `state`: an empty state to continue."""
    tap, k = RouterTap(model), top_k(model)
    parts: list[RouterCounts] = []
    sums: list[torch.Tensor] = []

    def take(w: torch.Tensor) -> None:
        logits = tap.take()
        parts.append(count(logits, w, k))
        for z in logits:
            probs = torch.softmax(z.detach().float(), dim=-1)
            sums.append((probs * w.reshape(-1).to(device=z.device, dtype=torch.float32)[:, None]).sum(0).cpu())

    def visit(node: Node, count: int, last: torch.Tensor | None) -> None:
        # one state for the walk (plans.depth_first): the parent's chunks, this node's appended, a sibling's dropped
        state.truncate(count)
        state.floor = count
        ids = node.input_ids(last)
        offset = state.length
        bounds = [(offset + s, offset + e) for s, e in chunk_bounds(ids.numel(), chunk_size)] if ids.numel() else []
        for j, (start, end) in enumerate(bounds):
            collect: Collected = {}
            tap.clear()
            run_segment(model, ids[start - offset:end - offset].unsqueeze(0), start, state.fork(), collect)
            take(weights.positions(node, start, end))
            state.append_chunk(start, end, collect)
            keep_owned(state, j, len(bounds))
        tail = node.tokens[-1:]
        leaves = [c for c in node.children if c.is_leaf]
        for lo in range(0, len(leaves), micro_batch):
            group = leaves[lo:lo + micro_batch]
            inputs, mask = pad([torch.cat([tail, leaf.tokens]) if leaf.start > 0 else leaf.tokens for leaf in group])
            tap.clear()
            run_segment(model, inputs, group[0].input_start, state.fork())
            take(weights.leaves(group, mask))
        # inner children next, the first on top: the walk's order, without recursion (a tree of any depth)
        inner = [child for child in reversed(node.children) if not child.is_leaf]
        if node is tree.root and path_end is not None:
            state.attach_path(path_end, leaves=False)
        pending.extend((child, state.num_chunks, tail) for child in inner)

    path_end = tree.path_end
    pending: list[tuple[Node, int, torch.Tensor | None]] = [(tree.root, state.num_chunks, None)]
    with torch.no_grad(), tap.hooked():
        while pending:
            visit(*pending.pop())
    if state.path is not None:
        state.detach_path()
    return functools.reduce(operator.add, parts).rounded(), torch.stack(sums).sum(0)
