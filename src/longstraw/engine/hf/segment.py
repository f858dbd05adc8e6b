"""Run a transformers decoder over a segment of new tokens that continues a captured prompt state.

We do not fork the model's code: the unmodified transformers modules compute embeddings, norms, RoPE, projections,
MLPs/MoE, conv and recurrent kernels. Two things are swapped, both through transformers' own extension points:

* the cache object: a `SegmentCache` (engine/hf/cache.py) answers the layers' cache calls functionally over a fork
  of the prompt state (recurrent/conv state, MLA latents, DSA indexer keys) and collects what each layer produced;
* the attention *kernel*, through `AttentionInterface`: `_longstraw_attention` attends to the prompt's
  chunks in place (read from the state) and to the segment's own tokens, merged exactly by log-sum-exp.

The same function serves capture (prompt chunk c against chunks < c), replay (responses against the whole
prompt) and decoding (one token per sequence against the prompt and the tokens generated so far)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from transformers import AttentionInterface

from longstraw.engine.hf.active import active_cache, running
from longstraw.engine.hf.cache import SegmentCache, StateCollected
from longstraw.engine.hf.composite import text_config, text_decoder
from longstraw.engine.hf.mamba1 import MAMBA1_MODEL_TYPES, mamba1_mixers
from longstraw.engine.kernels.attention import masked_prefix_attention, prefix_attention
from longstraw.engine.state.prompt import Collected, PromptState
from longstraw.engine.state.response import ResponseState
from longstraw.engine.state.sharing import kv_source
from longstraw.models.architecture import cache_keyword, check_transformers_for, hf

ATTN_NAME = "longstraw"

# Keyword arguments of transformers' attention modules that leave LongStraw's attention as it is: positions (RoPE is
# applied before the kernel), output flags and loss bookkeeping; `is_causal` may be True or None only. `_check_kwargs`
# refuses any other that is not None (packed-sequence lengths, position biases, a future mechanism).
_HARMLESS_KWARGS = frozenset({"position_ids", "use_cache", "output_attentions", "output_hidden_states",
                              "output_router_logits", "num_items_in_batch", "cache_position", "is_causal"})


def _check_kwargs(module: torch.nn.Module, kwargs: dict) -> None:
    """Refuse attention keyword arguments that would change the math LongStraw computes (see _HARMLESS_KWARGS)."""
    where = f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"
    if kwargs.get("is_causal") is False:
        raise ValueError(f"{where} asks for bidirectional attention (is_causal=False): LongStraw replays causal "
                         "decoders only")
    unknown = sorted(name for name, value in kwargs.items() if value is not None and name not in _HARMLESS_KWARGS)
    if unknown:
        raise ValueError(f"{where} passes attention argument(s) {', '.join(unknown)} that LongStraw's attention "
                         "does not compute: its result would be silently wrong. This model is not supported")


def _attention_chunk(module: torch.nn.Module, layer: int) -> int | None:
    """The attention chunk of a chunked-attention layer (Llama-4: `layer_types[layer] == "chunked_attention"`, a query
    sees only keys of its own `attention_chunk_size` positions), read from the module's config; None for others."""
    config: Any = getattr(module, "config", None)
    types = getattr(config, "layer_types", None)
    if types is not None and types[layer] == "chunked_attention":
        return int(config.attention_chunk_size)
    return None


def _mask_window(module: torch.nn.Module, sliding_window: int | None) -> int | None:
    """The sliding window of this attention call. Most families pass it as the `sliding_window` keyword; two apply it
    through their attention mask only, which LongStraw's kernel does not read: PhiMoE (every layer, the config's
    `sliding_window`, transformers' `create_sliding_window_causal_mask`) and Qwen2-MoE (its sliding layers, whose
    module holds `sliding_window`, with `use_sliding_window`)."""
    if sliding_window is not None:
        return sliding_window
    config = getattr(module, "config", None)
    holder = {"phimoe": config, "qwen2_moe": module}.get(getattr(config, "model_type", ""))
    return getattr(holder, "sliding_window", None)


def _longstraw_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                         sliding_window: int | None = None, softcap: float | None = None,
                         indices: torch.Tensor | None = None, s_aux: torch.Tensor | None = None,
                         longstraw: SegmentCache | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention signature: q (B, H, T, D), k/v (B, Hkv, S, D) -> ((B, T, H, D), None).

    k/v are the segment's own tokens (while decoding, every generated token's); the prompt's part comes from the
    state. Plain full attention takes the fused chunked kernel; sliding windows, DSA selections (`indices`, (B, T,
    topk) over [prompt ; own]), MLA latent prefixes, soft-capping and chunked attention take the masked path. s_aux:
    (H,) attention sinks (gpt-oss), on both paths."""
    # active_cache: for an attention module that does not pass its layer's keyword arguments on
    ctx = longstraw if longstraw is not None else active_cache()
    if ctx is None:
        raise RuntimeError("longstraw attention called without a SegmentCache (use replay.run_segment)")
    _check_kwargs(module, kwargs)
    sliding_window = _mask_window(module, sliding_window)
    if dropout:
        raise RuntimeError("attention dropout is active: put the model in eval() mode")
    layer: int | None = hf(module).layer_idx
    if layer is None or layer < 0:  # a block shared by several layers: the index its caller gave `update`
        layer = ctx.attending
    if layer is None:
        raise RuntimeError(f"{type(module).__name__} has no layer index and called the attention without updating "
                           "LongStraw's cache first: LongStraw cannot tell which layer's prompt K/V it reads")
    source = kv_source(module, layer)  # Gemma-4's KV-shared layers read an earlier layer's K/V
    if source == layer:
        ctx.note_window(layer, sliding_window)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    decoding = ctx.generated is not None
    prefix = ctx.state.attention_chunks(source)
    expand = getattr(module, "expand_kv", None)
    context_shards = ctx.state.context_shards if ctx.state.length > 0 else None
    chunk = _attention_chunk(module, layer)
    same_dims = value.shape[-1] == query.shape[-1]  # the chunked kernel's values have the query's head dim
    if (sliding_window is None and indices is None and expand is None and softcap is None and chunk is None
            and same_dims):
        # Decoding: one new token per sequence sees every generated token, so no causal mask among them.
        out = prefix_attention(query, key, value, [k for _, k, _ in prefix], [v for _, _, v in prefix], scale,
                               causal=not decoding, context_shards=context_shards, sinks=s_aux)
        return out.transpose(1, 2).contiguous(), None  # (B, T, H, D) as sdpa returns it: some layers .view it
    if context_shards is not None:
        raise ValueError("context parallelism covers full-attention and recurrent layers only (this layer uses a "
                         "sliding window, DSA or MLA): run without context parallelism")
    t, s = query.shape[2], key.shape[2]
    device = query.device
    q_pos = torch.arange(ctx.start, ctx.start + t, device=device)
    own_start = ctx.start + t - s  # decoding: own keys are the generated tokens up to and including this one
    own_pos = torch.arange(own_start, own_start + s, device=device)
    select = None
    if indices is not None:  # DSA: (B, T, topk) positions over [prompt ; own] -> (B, T, P' + S) bool
        select = torch.zeros(query.shape[0], t, own_start + s, dtype=torch.bool, device=device)
        select.scatter_(-1, indices.long(), True)
    out = masked_prefix_attention(query, key, value, prefix, scale, q_pos, own_pos, window=sliding_window,
                                  select=select, expand=expand, softcap=softcap, sinks=s_aux, chunk=chunk)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_NAME, _longstraw_attention)


@contextmanager
def attention_kernel(config: Any, name: str = ATTN_NAME) -> Iterator[None]:
    """`config`'s attention kernel set to `name` (LongStraw's by default) within the block, then restored."""
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


def has_indexer(model: torch.nn.Module) -> bool:
    """DSA models (GLM-5): some attention layer carries a top-k indexer, which reads a 4-D mask. Read from the
    config (O(1)), not by walking the modules: this runs once per replay and per decoding step."""
    return getattr(text_config(model), "index_topk", None) is not None


def _indexer_mask(batch: int, t: int, start: int, device) -> torch.Tensor:
    """(B, 1, T, start + T) bool: causal visibility over [prompt ; segment], what the DSA indexer masks with."""
    q_pos = torch.arange(start, start + t, device=device)
    k_pos = torch.arange(start + t, device=device)
    return (k_pos[None, :] <= q_pos[:, None])[None, None].expand(batch, 1, t, start + t)


def run_segment(model: torch.nn.Module, input_ids: torch.Tensor, start: int, state: PromptState,
                collect: Collected | None = None, generated: ResponseState | None = None,
                kv_only: bool = False) -> torch.Tensor | None:
    """Hidden states after the final norm for `input_ids` (B, T) at positions start..start+T-1. Every sequence of the
    batch continues the same prompt state (batch 1, shared). With `generated` (sampling), T must be 1 and the step also
    attends to, and appends to, the sequences' generated state. With `kv_only` (needs `collect`), the forward stops as
    soon as every layer's state is in `collect` and None is returned. Returns (B, T, hidden) otherwise."""
    model_type = hf(model).config.model_type
    check_transformers_for(model_type)
    b, t = input_ids.shape
    if generated is not None and t != 1:
        raise ValueError(f"decoding takes one token per sequence per step, got {t}")
    if generated is not None and collect is None:
        collect = {}
    cache = SegmentCache(state, start, b, collect=collect, generated=generated, kv_only=kv_only)
    position_ids = (torch.arange(t, device=input_ids.device) + start).unsqueeze(0).expand(b, t)
    # keys of the DSA indexer's mask: prompt, generated so far, this segment
    mask = _indexer_mask(b, t, start, input_ids.device) if has_indexer(model) else None
    base = text_decoder(model)
    # Mamba-1 mixers continue the SSM state through LongStraw's scan (engine/hf/mamba1.py).
    mixers = mamba1_mixers(hf(base).layers) if model_type in MAMBA1_MODEL_TYPES else nullcontext()
    with attention_kernel(text_config(model)), running(cache), mixers:
        try:
            out = base(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                       use_cache=False, longstraw=cache, **{cache_keyword(base): cache})
        except StateCollected:
            out = None
    cache.check_asked(model_type)
    if out is None:
        return None
    cache.finish()
    if generated is not None:
        assert collect is not None  # set above whenever generated is
        generated.advance(t, collect)
    return out.last_hidden_state
