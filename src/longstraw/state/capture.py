"""Chunked, no-grad prefill of the shared prompt into a `KVState`."""

from __future__ import annotations

import torch

from longstraw.replay import run_segment
from longstraw.state.attention import KVState


def chunk_bounds(length: int, chunk_size: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk; the last one may be shorter."""
    return [(s, min(s + chunk_size, length)) for s in range(0, length, chunk_size)]


def capture_prompt(model: torch.nn.Module, ids: torch.Tensor, chunk_size: int) -> KVState:
    """K/V of every layer for `ids` (N,), computed chunk by chunk under no_grad.

    Chunk c attends to the chunks before it through the state itself, so peak activation memory is one
    chunk's, and the result does not depend on the chunk size (up to float reassociation).
    """
    state = KVState(num_layers=model.config.num_hidden_layers)
    for start, end in chunk_bounds(ids.numel(), chunk_size):
        collect: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            run_segment(model, ids[start:end].unsqueeze(0), start, state.fork(), collect, kv_only=True)
        state.append_chunk(start, end, collect)
    return state
