"""Per-layer activation checkpointing of a transformers decoder, compatible with `SegmentCache`.

With `checkpoint="layers"`, a forward with grad keeps only each decoder layer's input (B, T, d) and recomputes
the layer's activations when the backward reaches it, so one micro-batch of responses (or one prompt-backward
chunk of the exact plan) keeps L·T·d numbers plus one layer's activations instead of every layer's.

Why not transformers' own `gradient_checkpointing_enable`: it acts only in `train()` mode (we run in eval, no
dropout) and it sets the `cache` argument to None, which would drop our `SegmentCache`, the object through which
a layer reads the prompt state. Here each layer's `forward` is wrapped (an instance attribute, for the duration of
the block) by `torch.utils.checkpoint` in its non-reentrant form, which passes keyword arguments through (the cache,
the rotary embeddings, the mask), lets gradients flow into tensors that are not arguments (the prompt state's leaves
the layer reads from the cache: the recompute re-reads them), and stops a recompute as soon as the saved tensors it
needs exist again (a prompt-backward chunk's stops at the last layer's K/V, as its forward did: `kv_only`).

A recompute must not repeat the cache's side effects (collect a layer's state again, or show a conv layer another
window than the first run's): the wrapper tells the cache (`SegmentCache.layer`) which layer runs and whether it is
a recompute. Module hooks (FSDP2's all-gather/reshard) run around `__call__`, outside the wrapped `forward`, as in
transformers' own implementation: a recompute runs while FSDP2's pre-backward hook holds the layer's parameters."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint

from longstraw.choices import CHECKPOINT_CHOICES
from longstraw.engine.hf.active import active_cache, running
from longstraw.engine.hf.composite import text_config, text_decoder
from longstraw.engine.hf.mamba1 import mamba1_mixers
from longstraw.engine.hf.segment import attention_kernel


def check_checkpoint(value: object) -> str:
    """The checkpoint option, validated: 'none' (default) or 'layers'."""
    if value not in CHECKPOINT_CHOICES:
        raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINT_CHOICES)}, got {value!r}")
    return str(value)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder's layer list: `layers` of the text decoder (`composite.text_decoder`) or of the decoder it holds
    (OPT), `h` (GPT-2, BLOOM, CodeGen and the other GPT-2-style decoders) or `blocks` (MPT)."""
    decoder = text_decoder(model)
    decoder = getattr(decoder, "decoder", decoder)  # OPT: the base model holds a decoder
    for name in _LAYER_LISTS:
        layers = getattr(decoder, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__} has no decoder layer list ({', '.join(_LAYER_LISTS)}) in its base "
                     "model: LongStraw cannot find its decoder layers")


# The names under which transformers' decoders keep their layer list.
_LAYER_LISTS = ("layers", "h", "blocks")


def _wrap(layer: torch.nn.Module, index: int, config):
    inner = type(layer).forward  # the class's forward (transformers' own wrapper is a no-op in eval mode)

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(layer, *args, **kwargs)  # nothing is saved without grad: nothing to recompute
        # Without the `longstraw` keyword (Mamba, Falcon-Mamba pass their mixer the cache alone): the running segment's.
        cache = kwargs.get("longstraw") or active_cache()
        # The recompute runs in the backward, after the forward's block (`segment.attention_kernel`) has restored
        # the model's own attention kernel: it must run with the kernel of the first run.
        kernel = config._attn_implementation
        runs = 0

        def run(*a, **kw):
            nonlocal runs
            runs += 1
            with attention_kernel(config, kernel):
                if cache is None:
                    return inner(layer, *a, **kw)
                # A Mamba-1 mixer's recompute must continue its state as the first run did (engine/hf/mamba1.py).
                with cache.layer(index, recompute=runs > 1), running(cache), mamba1_mixers([layer]):
                    return inner(layer, *a, **kw)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    return forward


@contextmanager
def checkpointed_layers(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, every decoder layer of `model` keeps only its input for the backward (see module doc)."""
    if not enabled:
        yield
        return
    # Layers already wrapped (a nested block) are left to the outer block.
    wrapped = [(i, layer) for i, layer in enumerate(decoder_layers(model)) if "forward" not in vars(layer)]
    for i, layer in wrapped:
        layer.forward = _wrap(layer, i, text_config(model))
    try:
        yield
    finally:
        for _, layer in wrapped:
            del layer.forward
