"""The plans of a prefix tree (docs/trees.md §3).

* `standard`: every trajectory a full sequence through the unmodified model — the reference.
* `exact`: depth first. A node's chunks are captured without grad and appended to the walk's one state, which holds the
  current root-to-node path (`depth_first`); its leaf children are replayed from it with grad (sibling leaves
  `micro_batch` at a time), its inner children visited the same way; then its own chunks are recomputed with grad, last
  first, and backpropagated with the gradient its descendants left on them plus its own tokens' loss
  (`backprop.prompt_backward` with a `ChunkLoss`): the gradient reaches its parent's chunks, and the node's chunks are
  dropped. Memory: one root-to-leaf path's node states and one chunk's activations, whatever the tree's width.
* `detach`: the same walk with every state a constant: a node's own loss tokens get their gradient from their chunk's
  forward (the parent's state constant), each leaf from its replay; no gradient flows into a node's state."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import torch

from longstraw.engine.backprop import prompt_backward
from longstraw.engine.grad_buffers import GradBuffers, row_grad_embedding
from longstraw.engine.hf.composite import text_config
from longstraw.engine.hf.segment import run_segment
from longstraw.engine.linear_loss import LossOf, linear_loss
from longstraw.engine.options import BackwardOptions
from longstraw.engine.pad import pad
from longstraw.engine.precision import accumulation_dtype, dtype_name
from longstraw.engine.state.capture import chunk_bounds, extend_state, keep_owned
from longstraw.engine.state.prompt import Collected, PromptState
from longstraw.engine.state.sharing import kv_shared_layers
from longstraw.engine.tree.build import Node, Tree
from longstraw.engine.tree.loss import TreeLoss, node_first_target
from longstraw.engine.tree.routes import TreeRouter
from longstraw.models.architecture import hf, logit_scale, logit_softcap, stateless_layers


@dataclass
class Walk:
    """What one walk of the tree needs: the model, its options, the loss, and the running totals."""

    model: torch.nn.Module
    tree: Tree
    loss: TreeLoss
    options: BackwardOptions
    total: float = 0.0
    path_bytes: int = 0  # the states held along the current path
    peak_path_bytes: int = 0
    replay_s: float = 0.0
    capture_s: float = 0.0
    backward_s: float = 0.0
    grad: bool = True  # False: the forwards build no graph (the first pass of engine/tree/sequence.py)
    router: TreeRouter | None = None  # the router load-balancing term (tree/routes.py)
    root_state: PromptState | None = None  # the root's state, captured already (a group's reused prompt state)
    names: str = "trajectories"  # what errors call the trajectories (a group's: "responses")
    backwards: int = 0  # pieces of the loss backpropagated so far
    buffers: GradBuffers | None = None  # where the replays form the head's weight gradient (`detach`)

    def hold(self, state: PromptState, first: int) -> int:
        """Count the bytes of `state`'s chunks first … (what a node's capture added) as held on the current path;
        the caller releases them (`path_bytes -= held`) when the node's state is freed."""
        held = sum(t.numel() * t.element_size() for per_layer in state.parts.values() for layer in per_layer
                   for t in layer[first:] if t is not None)
        self.path_bytes += held
        self.peak_path_bytes = max(self.peak_path_bytes, self.path_bytes)
        return held

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None, float, float | None]:
        out = hf(self.model).get_output_embeddings()
        return out.weight, getattr(out, "bias", None), logit_scale(self.model), logit_softcap(self.model)


def empty_state(model: torch.nn.Module, keep_boundaries: bool, options: BackwardOptions) -> PromptState:
    """The state of no position, which a tree's root continues (as `capture_prompt` makes it)."""
    device = hf(model).get_input_embeddings().weight.device if options.offload_state else None
    return PromptState(num_layers=text_config(model).num_hidden_layers, keep_boundaries=keep_boundaries,
                       device=device, context_shards=options.context_shards,
                       stateless=stateless_layers(model) | kv_shared_layers(text_config(model)))


Enter = Callable[[Walk, Node, PromptState, torch.Tensor, bool], Callable[[], None]]


def depth_first(walk: Walk, exact: bool, enter: Enter) -> None:
    """Visit every node of `walk.tree`, parents before children, siblings in order, with an explicit stack (a tree of
    any depth). enter(walk, node, state, path, captured) extends `state` by the node's tokens (path (node.end,): the
    tokens at positions 0 … node.end − 1; captured: the state holds them already, a reused root state), replays its
    leaf children, and returns what to run once its inner children are visited.

    One state serves the whole walk: a node's chunks are appended to it, and dropped once the node is left, so it
    holds the current root-to-node path; past the root the path's K/V sit in one tensor per layer (`PathSlab`; leaves
    that collect the gradient when `exact`). Every path of tokens is a view of one buffer the same way: a node's
    children write their tokens after its end, a sibling after the node's visit ended."""
    state, captured = _root_state(walk, exact)
    root = walk.tree.root
    base = state.num_chunks
    buffer = root.tokens.new_empty(max(t.length for t in walk.tree.trajectories))
    buffer[: root.end] = root.tokens
    path_end = walk.tree.path_end
    # detach's replays form the head's weight gradient in one reused buffer; exact's do not: there a buffer idle
    # between a replay's head and embedding backward, beside the prompt state's gradient, raised Bench B1's peak
    walk.buffers = None if exact else GradBuffers()
    try:
        state.floor = base
        with row_grad_embedding(hf(walk.model).get_input_embeddings()):
            stack = [(enter(walk, root, state, buffer[: root.end], captured), _inner(root), base)]
            if path_end is not None:  # nodes below the root: their chunks continue the root's state in place
                state.attach_path(path_end, leaves=exact)
            while stack:
                leave, inner, count = stack[-1]
                child = next(inner, None)
                if child is None:
                    stack.pop()
                    leave()
                    if stack:  # the node's chunks (the root's stay)
                        state.truncate(count)
                    continue
                buffer[child.start: child.end] = child.tokens
                count = state.floor = state.num_chunks
                stack.append((enter(walk, child, state, buffer[: child.end], False), _inner(child), count))
    finally:
        if state.path is not None:
            state.detach_path()
        state.floor = 0
        walk.buffers = None


def _inner(node: Node) -> Iterator[Node]:
    return (c for c in node.children if not c.is_leaf)


# --- exact --------------------------------------------------------------------------------------------------------
class _NodeLoss:
    """A node's loss for `prompt_backward`: chunk [start, end) of its input predicts the tokens at start+1 … end."""

    def __init__(self, walk: Walk, node: Node, path: torch.Tensor) -> None:
        self.walk, self.node, self.path = walk, node, path

    def wants(self, start: int, end: int) -> bool:
        return bool(self.walk.loss.keep(self.node.through, start + 1, end - start).any())

    def __call__(self, start: int, end: int, hidden: torch.Tensor) -> torch.Tensor | None:
        targets = self.path[start + 1: end + 1].unsqueeze(0)  # (1, T)
        through = self.node.through
        keep = self.walk.loss.keep(through, start + 1, end - start).unsqueeze(0)
        term, logp = _scored(self.walk, hidden, targets, keep, through,
                             lambda lp: self.walk.loss.term(through, start + 1, lp[0]))  # logp (1, T)
        if term is not None:
            _check_finite(logp, keep, term, f"positions {start + 1}–{end}")
            self.walk.total += float(term.detach())
        return term


def _root_state(walk: Walk, keep_boundaries: bool) -> tuple[PromptState, bool]:
    """The state the root continues, and whether it holds the root's own tokens already (`Walk.root_state`)."""
    if walk.root_state is not None:
        return walk.root_state, True
    state = empty_state(walk.model, keep_boundaries, walk.options)
    state.capacity = max(walk.tree.root.tokens.numel() - 1, 0)  # the root's K/V in one tensor per layer (`_slab`)
    return state, False


def exact(walk: Walk) -> None:
    depth_first(walk, True, _exact_node)


def _exact_node(walk: Walk, node: Node, state: PromptState, path: torch.Tensor, captured: bool) -> Callable[[], None]:
    """`depth_first`'s enter: capture `node` into the state of its parent's path (positions [0, node.input_start)) and
    replay its leaf children; then, once its inner children are visited, recompute and backpropagate its chunks."""
    above = path[: node.start]
    first = 0 if captured else state.num_chunks
    ids = node.input_ids(above[-1:] if above.numel() else None)
    own = _NodeLoss(walk, node, path)
    # keep_prompt_graph: the node's last chunks keep their capture graph, which its backward then uses instead of a
    # recompute; a node with loss tokens of its own recomputes them (the capture computes no log-probs).
    keep = 0 if own.wants(state.length, state.length + ids.numel()) else walk.options.keep_prompt_graph
    t0 = time.perf_counter()
    if not captured:
        extend_state(walk.model, state, ids, walk.options.chunk_size, leaves=True, keep_graph=keep)
    walk.capture_s += time.perf_counter() - t0
    held = walk.hold(state, first)
    _replay_children(walk, node, state, path)

    def leave() -> None:
        t0 = time.perf_counter()
        router = walk.router
        prompt_backward(walk.model, path, state, first=first, chunk_loss=own,
                        router=None if router is None else router.aux,
                        router_weights=None if router is None else partial(router.weights.positions, node))
        walk.backward_s += time.perf_counter() - t0
        walk.path_bytes -= held

    return leave


# --- detach -------------------------------------------------------------------------------------------------------
def detach(walk: Walk) -> None:
    depth_first(walk, False, _detach_node)


def _detach_node(walk: Walk, node: Node, state: PromptState, path: torch.Tensor, captured: bool) -> Callable[[], None]:
    """Capture `node` as a constant continuing its parent's path; its own loss tokens' terms are backpropagated
    from their chunk's forward (into the parameters only). The router term's share is the leaves' only: like every
    path through a node's state, the node tokens' share is left out (`depth_first`'s enter)."""
    above = path[: node.start]
    first = 0 if captured else state.num_chunks
    ids = node.input_ids(above[-1:] if above.numel() else None)
    t0 = time.perf_counter()
    offset = state.length
    scored = _NodeLoss(walk, node, path)
    bounds = [] if captured else [(offset + s, offset + e)
                                  for s, e in chunk_bounds(ids.numel(), walk.options.chunk_size)]
    for j, (start, end) in enumerate(bounds):
        collect: Collected = {}
        wanted = scored.wants(start, end)
        with torch.set_grad_enabled(wanted and walk.grad):
            hidden = run_segment(walk.model, ids[start - offset: end - offset].unsqueeze(0), start, state.fork(),
                                 collect, kv_only=not wanted)
            term = scored(start, end, hidden) if wanted and hidden is not None else None
            if term is not None and term.requires_grad:
                term.backward()
        del hidden, term
        for parts in collect.values():  # a constant: no graph back into the chunk's forward (a window is an int)
            parts.update({name: t.detach() for name, t in parts.items() if isinstance(t, torch.Tensor)})
        state.append_chunk(start, end, collect)
        keep_owned(state, j, len(bounds))
    walk.capture_s += time.perf_counter() - t0
    held = walk.hold(state, first)
    _replay_children(walk, node, state, path)

    def leave() -> None:
        walk.path_bytes -= held

    return leave


# --- both: the leaf children of a node ------------------------------------------------------------------------------
def _replay_children(walk: Walk, node: Node, state: PromptState, path: torch.Tensor) -> None:
    """Replay `node`'s leaf children from `state`, `micro_batch` siblings at a time (inner ones: `depth_first`'s)."""
    leaves = [c for c in node.children if c.is_leaf]
    k = walk.options.micro_batch
    t0 = time.perf_counter()
    for first in range(0, len(leaves), k):
        _replay_leaves(walk, leaves[first: first + k], state, path)
    walk.replay_s += time.perf_counter() - t0


def _replay_leaves(walk: Walk, leaves: list[Node], state: PromptState, above: torch.Tensor) -> None:
    """Forward+backward sibling leaves (all starting at the same position) from their parent's state."""
    last = above[-1:] if above.numel() else None
    router = walk.router if walk.grad else None
    # with the router term each leaf runs all its tokens, its last one too (the batch's forward routes it)
    inputs_list = [leaf.input_ids(last) if router is None else torch.cat([leaf.input_ids(last), leaf.tokens[-1:]])
                   for leaf in leaves]
    starts = [node_first_target(leaf) for leaf in leaves]
    targets_list = [leaf.tokens[s - leaf.start:] for leaf, s in zip(leaves, starts)]
    inputs, routed = pad(inputs_list)  # (k, T), or (k, T + 1) with the router term
    targets, mask = pad(targets_list)  # (k, T)
    if inputs.shape[1] == 1:
        # One-token segments: pad to two. transformers' SSM layers take an in-place single-token path that autograd
        # cannot differentiate; causality keeps the padding out of the real position.
        inputs = torch.nn.functional.pad(inputs, (0, 1))
        targets, mask = torch.nn.functional.pad(targets, (0, 1)), torch.nn.functional.pad(mask, (0, 1))
    keep = torch.zeros_like(mask)
    for row, (leaf, s) in enumerate(zip(leaves, starts)):
        keep[row, : targets_list[row].numel()] = walk.loss.keep(leaf.through, s, targets_list[row].numel())
    if not bool(keep.any()) and router is None:
        return
    start = leaves[0].input_start
    if router is not None:
        router.aux.tap.clear()

    def loss_of(logp: torch.Tensor) -> torch.Tensor | None:
        """The leaves' share of the loss from their log-probs (k, T)."""
        terms = [walk.loss.term(leaf.through, s, logp[row, : targets_list[row].numel()])
                 for row, (leaf, s) in enumerate(zip(leaves, starts))]
        present = [t for t in terms if t is not None]
        return torch.stack(present).sum() if present else None

    with torch.set_grad_enabled(walk.grad):
        hidden = run_segment(walk.model, inputs, start, state.fork())  # (k, T, d)
        assert hidden is not None
        through = [i for leaf in leaves for i in leaf.through]
        term, logp = _scored(walk, hidden[:, : targets.shape[1]], targets, keep, through, loss_of)  # logp (k, T)
        if router is not None:
            routed_term = router.aux.term(router.weights.leaves(leaves, routed))
            term = routed_term if term is None else term + routed_term
    if term is None:
        term = torch.zeros((), dtype=logp.dtype, device=logp.device)
    _check_finite(logp, keep, term, f"{walk.names} {through}")
    walk.total += float(term.detach())
    if term.requires_grad:
        term.backward()
        walk.backwards += 1


def _scored(walk: Walk, hidden: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor, through: list[int],
            loss_of: LossOf) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The loss `loss_of` gives the log-probs (k, T) of `targets` at the `keep` positions (0 elsewhere), from the
    final hidden states (k, T, d) of the trajectories `through`, and those log-probs (detached): the fused
    linear-and-loss pass (`engine/linear_loss.py`)."""
    weight, bias, scale, softcap = walk.head()
    return linear_loss(hidden, weight, targets, keep, loss_of, walk.loss.token_level(through),
                       walk.options.token_chunk, walk.options.temperature, scale, softcap, bias, walk.buffers)


def _check_finite(logp: torch.Tensor, keep: torch.Tensor, term: torch.Tensor, where: str) -> None:
    """Refuse a piece of the loss before its backward if its log-probs or its value are not finite."""
    dtype = dtype_name(logp.dtype)
    if not torch.isfinite(logp.detach()[keep]).all():
        raise FloatingPointError(f"{where}: the model's log-probs are not finite (its forward overflowed in {dtype}); "
                                 "this piece's backward was not run. Use float32 or bfloat16, or check the weights")
    if not torch.isfinite(term.detach()):
        raise FloatingPointError(
            f"{where}: their share of the loss is {float(term.detach())} (the ratio exp(logp - old) or the KL term "
            f"exp(ref - logp) overflowed {dtype}); this piece's backward was not run. Check old_logprobs/ref_logprobs "
            "(the policy's own log-probs, not logits) and the advantages, or use a wider dtype")


def _device(walk: Walk) -> torch.device:
    return hf(walk.model).get_input_embeddings().weight.device


# --- standard -----------------------------------------------------------------------------------------------------
def standard(walk: Walk, batched: bool) -> None:
    """Every trajectory as a full sequence through the unmodified model (its own attention and logits),
    `micro_batch` sequences per forward (all of them when `batched`), right-padded."""
    trajectories = walk.tree.trajectories
    k = len(trajectories) if batched else walk.options.micro_batch
    device = _device(walk)
    t0 = time.perf_counter()
    for first in range(0, len(trajectories), k):
        idx = list(range(first, min(first + k, len(trajectories))))
        ids, mask = pad([trajectories[i].ids.to(device=device, dtype=torch.long) for i in idx])  # (k, N_max)
        low = min(trajectories[i].loss_start for i in idx)  # the first position any row scores
        kept = ids.shape[1] - low  # logits of input positions low − 1 … N_max − 2
        if walk.router is None:
            logits = walk.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1].long(), logits_to_keep=kept,
                                use_cache=False).logits
        else:  # every token routed, the last one too, as the batch's forward routes it
            walk.router.aux.tap.clear()
            logits = walk.model(input_ids=ids, attention_mask=mask.long(), logits_to_keep=kept + 1,
                                use_cache=False).logits[:, :-1]
        logits = logits.to(accumulation_dtype(logits.dtype))
        if walk.options.temperature != 1.0:
            logits = logits / walk.options.temperature
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, low:].unsqueeze(-1)).squeeze(-1)  # (k, kept)
        del logits  # (k, kept, V): log_softmax keeps its own output for the backward, not its input
        terms = [walk.loss.term([i], low, logp[row, : trajectories[i].length - low]) for row, i in enumerate(idx)]
        term = torch.stack([t for t in terms if t is not None]).sum()
        if walk.router is not None:
            term = term + walk.router.aux.term(mask.to(torch.float64))
        keep = torch.zeros_like(logp, dtype=torch.bool)
        for row, i in enumerate(idx):
            keep[row, : trajectories[i].length - low] = walk.loss.keep([i], low, trajectories[i].length - low)
        _check_finite(logp, keep, term, f"{walk.names} {idx}")
        walk.total += float(term.detach())
        term.backward()
        walk.backwards += 1
    walk.replay_s += time.perf_counter() - t0
