"""Chunked prefill of the shared prompt into a `PromptState` (no grad, but for the exact plan's kept chunks)."""

from __future__ import annotations

import torch

from longstraw.engine.hf.composite import text_config
from longstraw.engine.hf.segment import run_segment
from longstraw.engine.state.prompt import Collected, PromptState, prompt_fingerprint
from longstraw.engine.state.provenance import provenance
from longstraw.engine.state.sharding import ContextShards
from longstraw.engine.state.sharing import kv_shared_layers
from longstraw.models.architecture import hf, stateless_layers


def chunk_bounds(length: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk; the last one may be shorter, but never a single token after a full
    chunk (it joins the previous one): transformers' SSM layers take an in-place single-token path for a
    one-token continuation, which the exact plan's recompute could not differentiate through."""
    bounds = [(s, min(s + chunk_size, length)) for s in range(0, length, chunk_size)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], length)]
    return bounds


def capture_prompt(model: torch.nn.Module, ids: torch.Tensor, chunk_size: int,
                   keep_boundaries: bool = True, context_shards: ContextShards | None = None,
                   offload: bool = False, leaves: bool = False, keep_graph: int = 0) -> PromptState:
    """The state of every layer for `ids` (N,), computed chunk by chunk under no_grad (but for `keep_graph`). Chunk c
    continues from the state of the chunks before it, so peak activation memory is one chunk's, and the result does not
    depend on the chunk size (up to float reassociation). keep_boundaries: keep the recurrent state at every chunk
    boundary (the exact plan needs them; `PromptState`). context_shards: every rank runs every chunk, and keeps the
    attention parts of its own contiguous slice of chunks only. offload: keep the state in host memory, read on the
    model's device (`PromptState.device`).

    leaves (the exact plan): store every part as a leaf that requires grad (`PromptState.as_leaves`) as it is captured,
    so that later chunks read leaves. keep_graph (needs leaves): the last `keep_graph` chunks run with grad, their
    autograd graph kept in `PromptState.graphs`: the exact plan's prompt backward then backpropagates through it instead
    of recomputing chunk j's forward, at the cost of those chunks' activations from here until their backward."""
    if keep_graph and not leaves:
        raise ValueError("keep_graph keeps the graph from the state's leaves: capture with leaves=True")
    device = hf(model).get_input_embeddings().weight.device if offload else None
    # capacity: full-attention K/V go into one tensor per layer as chunks arrive (`PromptState._slab`)
    state = PromptState(num_layers=text_config(model).num_hidden_layers, keep_boundaries=keep_boundaries,
                        context_shards=context_shards, device=device, fingerprint=prompt_fingerprint(ids),
                        provenance=provenance(model), capacity=ids.numel(),
                        stateless=stateless_layers(model) | kv_shared_layers(text_config(model)))
    extend_state(model, state, ids, chunk_size, leaves=leaves, keep_graph=keep_graph)
    return state


def extend_state(model: torch.nn.Module, state: PromptState, ids: torch.Tensor, chunk_size: int,
                 leaves: bool = False, keep_graph: int = 0) -> None:
    """Append the state of `ids` (n,), the tokens at positions state.length … state.length + n − 1, to `state`, in
    chunks of `chunk_size` (`capture_prompt`'s loop; a prefix tree's node continues its parent's state with it).
    leaves / keep_graph: as `capture_prompt`'s. Under context parallelism these ids' chunks are split over the ranks
    as a prompt's are (`keep_owned`)."""
    offset = state.length
    bounds = [(offset + s, offset + e) for s, e in chunk_bounds(ids.numel(), chunk_size)]
    for j, (start, end) in enumerate(bounds):
        collect: Collected = {}
        graph = j >= len(bounds) - keep_graph
        with torch.set_grad_enabled(graph):
            run_segment(model, ids[start - offset:end - offset].unsqueeze(0), start, state.fork(), collect,
                        kv_only=True)
        if graph:
            state.graphs[state.num_chunks] = PromptState.outputs_of(collect, state.num_layers)
        state.append_chunk(start, end, collect, leaves=leaves)
        keep_owned(state, j, len(bounds))


def keep_owned(state: PromptState, j: int, count: int) -> None:
    """Context parallelism: the chunk just appended is chunk j of a run of `count` split over the ranks; record its
    owner, and drop its attention parts unless this rank is that owner. Nothing without context parallelism."""
    shards = state.context_shards
    if shards is None:
        return
    state.owners.append(shards.owner(j, count))
    if not shards.owns(j, count):
        state.drop_attention(state.num_chunks - 1)
