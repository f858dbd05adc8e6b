"""The reverse chunked backward of an encoded run of tokens (a group's prompt, a prefix tree's node) from the
gradient its readers left on its state (docs/design.md §3).

After every reader (a response's replay, a child node) ran against the state as grad-requiring leaves, each leaf's
`.grad` holds dL/dS for its part of the state (K/V or latent chunks, and for recurrent layers the state after each
chunk). For chunk c = last … first the chunk's forward is recomputed with grad from the state before it (all leaves) and
what chunk c produced — its K/V slice and its end-of-chunk recurrent/conv state — is backpropagated with the upstream
gradients accumulated so far: parameters receive the chunk's share of the gradient, and the state before chunk c
receives its share. Peak: one chunk's activations + one copy of the state's gradient. A chunk whose capture kept its
graph (`PromptState.graphs`, keep_prompt_graph) is backpropagated through that graph instead of a recompute."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from longstraw.engine.hf.segment import run_segment
from longstraw.engine.router import RouterAux
from longstraw.engine.state.prompt import GRAD_PARTS, Collected, PromptState
from longstraw.engine.state.sharding import ContextShards


class ChunkLoss(Protocol):
    """A loss on the tokens a recomputed chunk predicts (a prefix tree's node, `engine/tree`): `wants(start, end)`
    says whether chunk [start, end) has any, and the call returns that part of the loss from the chunk's hidden
    states (1, end − start, d) (None: nothing there)."""

    def wants(self, start: int, end: int) -> bool: ...

    def __call__(self, start: int, end: int, hidden: torch.Tensor) -> torch.Tensor | None: ...


def prompt_backward(model: torch.nn.Module, ids: torch.Tensor, leaves: PromptState,
                    router: RouterAux | None = None, first: int = 0, chunk_loss: ChunkLoss | None = None,
                    router_weights: Callable[[int, int], torch.Tensor] | None = None) -> None:
    """ids: the encoded tokens by position (the prompt's x[:-1], or a tree node's path); leaves: the state the replays
    used, `.grad` filled. router: the router load-balancing term, whose share of the chunk's tokens (weighed by
    `router_weights(start, end)`, (end − start,)) joins each chunk's backward (none is then skipped). first:
    backpropagate chunks first … last only (a tree node's own: the state before them, its parent's, gets their
    gradient). chunk_loss: a loss on the tokens the chunks predict, added to each chunk's backward."""
    if not leaves.keep_boundaries and leaves.num_chunks > 1:
        raise ValueError("the exact plan needs the recurrent state at every chunk boundary: capture the prompt "
                         "with keep_boundaries=True")
    context_shards = leaves.context_shards
    for j in reversed(range(first, leaves.num_chunks)):
        start, end = leaves.bounds[j]
        upstream = leaves.gradients(j)
        kept = leaves.graphs.pop(j, None)  # the capture's own graph of chunk j, if it was kept
        scored = chunk_loss is not None and chunk_loss.wants(start, end)
        if context_shards is None and router is None and not scored and all(g is None for g in upstream):
            continue  # (under context parallelism every rank recomputes every chunk: collectives run in step)
        collect: Collected = {}
        term = None
        if kept is not None:
            recomputed = kept
        else:
            if router is not None:
                router.tap.clear()
            with torch.enable_grad():
                hidden = run_segment(model, ids[start:end].unsqueeze(0), start, leaves.prefix(j), collect,
                                     kv_only=router is None and not scored)
                if scored:
                    assert chunk_loss is not None and hidden is not None
                    term = chunk_loss(start, end, hidden)
                if router is not None:
                    assert router_weights is not None
                    routed = router.term(router_weights(start, end))
                    term = routed if term is None else term + routed
                del hidden
            recomputed = PromptState.outputs_of(collect, leaves.num_layers)
        if context_shards is not None:
            upstream = _owner_gradients(context_shards, leaves.owners[j], upstream, recomputed)
        # A part computed from frozen parameters and frozen inputs only (e.g. the first layer's K/V with the
        # embeddings and that layer frozen) has no trainable path: its gradient stops here.
        pairs = [(out, g) for out, g in zip(recomputed, upstream)
                 if g is not None and out is not None and out.requires_grad]
        if term is not None and term.requires_grad:
            pairs.append((term, torch.ones_like(term)))
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        leaves.clear_gradients(j)  # consumed: free this chunk's state gradient
        # and this chunk's recompute (or kept graph), before the next one runs
        del collect, recomputed, pairs, kept, term


def _owner_gradients(context_shards: ContextShards, owner: int, upstream: list, recomputed: list) -> list:
    """Context parallelism: a chunk's K/V gradients live on its owner (rank `owner`); every rank needs them to
    backpropagate its (replicated) recompute of the chunk. Recurrent parts are replicated: their gradients are local."""
    attention = [i for i, out in enumerate(recomputed) if out is not None and i % len(GRAD_PARTS) < 2]
    shared = context_shards.broadcast_from([upstream[i] for i in attention], [recomputed[i] for i in attention], owner)
    upstream = list(upstream)
    for i, g in zip(attention, shared):
        upstream[i] = g
    return upstream
