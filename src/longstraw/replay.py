"""Run a transformers decoder over a segment of new tokens that continues a captured prompt state.

We do not fork the model's code: the unmodified transformers modules compute embeddings, norms, RoPE,
projections and MLPs; only the attention *kernel* is swapped, through transformers' own
`AttentionInterface`, for `attention.prefix_attention`, which reads the prompt K/V from the state passed
down as the `longstraw` keyword (transformers forwards unknown keywords to the attention function).
The same function serves capture (prompt chunk c against chunks < c) and replay (responses against the
whole prompt), and it can hand each layer's new K/V back to the caller (`collect`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import AttentionInterface

from longstraw.attention import prefix_attention

if TYPE_CHECKING:  # state/ imports this module to capture; avoid the cycle at run time
    from longstraw.state.attention import KVState, ResponseKV

ATTN_NAME = "longstraw"


@dataclass
class SegmentContext:
    """What the attention kernel needs besides q/k/v: the prompt state to attend to, and where to put new K/V."""

    state: KVState
    collect: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    generated: ResponseKV | None = None  # sampling: earlier generated tokens' K/V, one token per step
    kv_only: bool = False  # stop the forward once the last layer's K/V are collected (capture, recompute)


class _KVCollected(Exception):
    """Raised inside the model once every layer's K/V is collected: the last layer's attention output, its
    MLP, the final norm and everything after would be computed for nothing."""


def _longstraw_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    longstraw: SegmentContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention signature: q (B, H, T, D), k/v (B, Hkv, T, D) -> ((B, T, H, D), None)."""
    if longstraw is None:
        raise RuntimeError("longstraw attention called without a SegmentContext (use replay.run_segment)")
    if dropout:
        raise RuntimeError("attention dropout is active: put the model in eval() mode")
    layer = module.layer_idx
    if longstraw.collect is not None:
        longstraw.collect[layer] = (key, value)
        if longstraw.kv_only and len(longstraw.collect) == longstraw.state.num_layers:
            raise _KVCollected
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    state = longstraw.state
    causal = True
    if longstraw.generated is not None:
        # One new token per sequence sees every token generated before it: no causal mask among them.
        key, value = longstraw.generated.write(layer, key, value)
        causal = False
    out = prefix_attention(query, key, value, state.keys[layer], state.values[layer], scale, causal=causal)
    return out.transpose(1, 2), None


AttentionInterface.register(ATTN_NAME, _longstraw_attention)


@contextmanager
def replay_attention(model: torch.nn.Module) -> Iterator[None]:
    """Swap the model's attention kernel for ours for the duration of the block, then restore it."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        config._attn_implementation = previous


def run_segment(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    start: int,
    state: KVState,
    collect: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
    generated: ResponseKV | None = None,
    kv_only: bool = False,
) -> torch.Tensor | None:
    """Hidden states after the final norm for `input_ids` (B, T) at positions start..start+T-1.

    Every sequence of the batch continues the same prompt state (batch 1, shared). With `generated`
    (sampling), T must be 1 and the step also attends to, and appends to, the sequences' generated K/V.
    With `kv_only` (needs `collect`), the forward stops as soon as every layer's K/V is in `collect` and
    None is returned. Returns (B, T, hidden) otherwise.
    """
    if kv_only and collect is None:
        raise ValueError("kv_only needs a collect dict to put the K/V in")
    b, t = input_ids.shape
    if generated is not None and t != 1:
        raise ValueError(f"decoding takes one token per sequence per step, got {t}")
    position_ids = (torch.arange(t, device=input_ids.device) + start).unsqueeze(0).expand(b, t)
    ctx = SegmentContext(state=state, collect=collect, generated=generated, kv_only=kv_only)
    with replay_attention(model):
        try:
            out = model.model(input_ids=input_ids, position_ids=position_ids, use_cache=False, longstraw=ctx)
        except _KVCollected:
            return None
    if generated is not None:
        generated.advance(t)
    return out.last_hidden_state
