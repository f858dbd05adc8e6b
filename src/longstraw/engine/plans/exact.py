"""The exact plan (ours; docs/design.md §3): the detach plan's replays with the prompt state as grad-requiring
leaves, then the reverse chunked prompt backward, so the gradient equals standard GRPO's.

After every response was replayed against the prompt state as leaves, each leaf's `.grad` holds dL/dS for
its part of the state (K/V or latent chunks, and for recurrent layers the state after the last chunk),
summed over the whole group. For chunk c = last … first we recompute chunk c's forward with grad from the
state before it (K/V chunks < c and the recurrent state after chunk c-1, all leaves) and backpropagate what
chunk c produced — its K/V slice and its end-of-chunk recurrent/conv state — with the upstream gradients
accumulated so far: parameters receive the prompt's share of the gradient, and the state before chunk c
receives its share, ready for the next iteration. Peak: one chunk's activations + one copy of the state's
gradient.

Kept graphs (`backward_group(keep_prompt_graph=N)`): the capture ran the last N chunks with grad from the leaves
and kept their graphs (`PromptState.graphs`); for those chunks the backward goes through the kept graph instead of
a recompute: one prompt forward fewer per kept chunk, for those chunks' activations held from the capture on.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from longstraw.engine.hf.segment import run_segment
from longstraw.engine.options import BackwardOptions
from longstraw.engine.plans.replay import LossFn, replay_responses
from longstraw.engine.router import RouterAux
from longstraw.engine.state.capture import capture_prompt
from longstraw.engine.state.prompt import GRAD_PARTS, Collected, PromptState
from longstraw.engine.state.sharding import ContextShards


def exact(model: torch.nn.Module, prompt: torch.Tensor, responses: list[torch.Tensor], loss_fn: LossFn,
          options: BackwardOptions, prompt_state: PromptState | None,
          stats: dict[str, float | int | str],
          loss_masks: list[torch.Tensor] | None = None,
          router: RouterAux | None = None) -> tuple[float, list[torch.Tensor]]:
    """prompt (P,), responses [(R_i,)]: the loss's full gradient into the parameters. Captures prompt[:-1] as
    leaves (with its last `keep_prompt_graph` chunks' graphs), or makes leaves of `prompt_state`; replays every
    response; then backpropagates the prompt. Phase times and the state's size go into `stats`. router: the router
    load-balancing term, added in the replays and in the prompt backward."""
    t0 = time.perf_counter()
    if prompt_state is None:
        state = capture_prompt(model, prompt[:-1], options.chunk_size, keep_boundaries=True,
                               context_shards=options.context_shards, offload=options.offload_state, leaves=True,
                               keep_graph=options.keep_prompt_graph)
    else:
        state = (prompt_state.offload(prompt.device) if options.offload_state else prompt_state).as_leaves()
    t1 = time.perf_counter()
    total, logprobs = replay_responses(model, prompt, state, responses, loss_fn, options.micro_batch,
                                       options.token_chunk, options.temperature, loss_masks, router)
    t2 = time.perf_counter()
    prompt_backward(model, prompt[:-1], state, router)
    stats.update(prompt_state_bytes=state.nbytes(), capture_s=t1 - t0, replay_s=t2 - t1,
                 prompt_backward_s=time.perf_counter() - t2)
    return total, logprobs


class ChunkLoss(Protocol):
    """A loss on the tokens a recomputed chunk predicts (a prefix tree's node, `engine/tree`): `wants(start, end)`
    says whether chunk [start, end) has any, and the call returns that part of the loss from the chunk's hidden
    states (1, end − start, d) (None: nothing there)."""

    def wants(self, start: int, end: int) -> bool: ...

    def __call__(self, start: int, end: int, hidden: torch.Tensor) -> torch.Tensor | None: ...


def prompt_backward(model: torch.nn.Module, ids: torch.Tensor, leaves: PromptState,
                    router: RouterAux | None = None, first: int = 0, chunk_loss: ChunkLoss | None = None) -> None:
    """ids: the encoded tokens by position (the prompt's x[:-1], or a tree node's path); leaves: the state the replays
    used, `.grad` filled. router: the router load-balancing term, whose prompt tokens' share joins each chunk's
    backward (each chunk then runs to the last layer's MoE block, and none is skipped). first: backpropagate chunks
    first … last only (a tree node's own chunks: the state before them, its parent's, receives their gradient).
    chunk_loss: a loss on the tokens the chunks predict, added to each chunk's backward."""
    if not leaves.keep_boundaries and leaves.num_chunks > 1:
        raise ValueError("the exact plan needs the recurrent state at every chunk boundary: capture the prompt "
                         "with keep_boundaries=True")
    context_shards = leaves.context_shards
    for j in reversed(range(first, leaves.num_chunks)):
        start, end = leaves.bounds[j]
        produced = leaves.chunk_outputs(j)
        # An offloaded state's gradients live beside it in host memory: bring chunk j's to the compute device.
        upstream = [None if t is None or t.grad is None else leaves.fetch(t.grad) for t in produced]
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
                if router is not None:
                    term = router.term(torch.full((end - start,), float(router.prompt_copies)))
                elif scored:
                    assert chunk_loss is not None and hidden is not None
                    term = chunk_loss(start, end, hidden)
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
        for t in produced:
            if t is not None:
                t.grad = None  # consumed: free this chunk's state gradient
        # and this chunk's recompute (or kept graph), before the next one runs
        del collect, recomputed, pairs, kept, term


def _owner_gradients(context_shards: ContextShards, owner: int, upstream: list, recomputed: list) -> list:
    """Context parallelism: a chunk's K/V gradients live on its owner (rank `owner`); every rank needs them to
    backpropagate its (replicated) recompute of the chunk. Recurrent parts are replicated, so their gradients are local.
    GRAD_PARTS order per layer: key, value, conv, recurrent."""
    attention = [i for i, out in enumerate(recomputed) if out is not None and i % len(GRAD_PARTS) < 2]
    shared = context_shards.broadcast_from([upstream[i] for i in attention], [recomputed[i] for i in attention],
                                           owner)
    upstream = list(upstream)
    for i, g in zip(attention, shared):
        upstream[i] = g
    return upstream
