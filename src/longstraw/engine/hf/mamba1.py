"""Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba's Mamba layers) continued from the prompt state.

transformers' torch path for these mixers runs a multi-token segment from a zero state (`mamba_selective_scan` takes
no initial state), and its one-token path updates the state in place in float32; no cache answer fixes that. So for
the duration of a segment each Mamba-1 mixer's `forward` is swapped (an instance attribute, deleted after) for
`mamba1_forward`, which runs the mixer's own submodules exactly as transformers' torch path does and replaces only
the scan by `kernels.selective_scan`, started from the state the cache holds (one-token segments too: none in place).

State per layer: the conv window (1, d_inner, K), kept by `SegmentCache.update_conv_state`, and the SSM state
(1, d_inner, N) in the scan's dtype (float32, or float64 for a float64 model), read without a copy
(`SegmentCache.read_recurrent_state`) and shared by every row of the segment.

A layer recomputed by per-layer activation checkpointing runs in the backward, after `run_segment`'s block has
ended: `activation_checkpointing` enters `mamba1_mixers` again around the recompute."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from transformers.models.falcon_mamba.modeling_falcon_mamba import FalconMambaMixer
from transformers.models.jamba.modeling_jamba import JambaMambaMixer
from transformers.models.mamba.modeling_mamba import MambaMixer

from longstraw.engine.hf.cache import SegmentCache
from longstraw.engine.kernels.selective_scan import selective_scan
from longstraw.models.architecture import hf

MAMBA1_MODEL_TYPES = ("mamba", "falcon_mamba", "jamba")
_MIXERS = (MambaMixer, FalconMambaMixer, JambaMambaMixer)
_NORMED = (FalconMambaMixer, JambaMambaMixer)  # RMS norms on dt, B and C before dt_proj and the scan


def mamba1_forward(module: torch.nn.Module, hidden_states: torch.Tensor, cache: object = None,
                   attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """The mixer's output (b, T, hidden) for `hidden_states` (b, T, hidden) continuing the cache's state. Without a
    `SegmentCache` (a plain forward of the model inside the block) the mixer's own forward runs."""
    cache = kwargs.pop("cache_params", None) if cache is None else cache
    if not isinstance(cache, SegmentCache):
        return type(module).forward(module, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    mixer = hf(module)
    layer = mixer.layer_idx
    length, dtype = hidden_states.shape[1], hidden_states.dtype
    state = cache.read_recurrent_state(layer)  # (1 or b, d_inner, N) or None at the prompt's first chunk
    if attention_mask is not None:  # a 2-D padding mask zeroes padded positions, as transformers does
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(dtype)
    x, gate = mixer.in_proj(hidden_states).transpose(1, 2).chunk(2, dim=1)  # (b, d_inner, T) each
    # [conv window ; x] (b, d_inner, K + T) through the causal conv; the window kept is its last K columns
    full = cache.update_conv_state(x, layer, conv_kernel_size=mixer.conv_kernel_size)
    x = mixer.act(mixer.conv1d(full.to(mixer.conv1d.weight.dtype))[..., : full.shape[-1]]).to(x.dtype)
    x = x[..., -length:]
    if attention_mask is not None:
        x = (x * attention_mask[:, None, :]).to(x.dtype)
    dt, B, C = torch.split(mixer.x_proj(x.transpose(1, 2)),
                           [mixer.time_step_rank, mixer.ssm_state_size, mixer.ssm_state_size], dim=-1)
    if isinstance(module, _NORMED):
        dt, B, C = mixer.dt_layernorm(dt), mixer.b_layernorm(B), mixer.c_layernorm(C)
    if hasattr(mixer.config, "_is_quantized"):  # transformers calls the (quantized) module and removes its bias
        dt = (mixer.dt_proj(dt) - mixer.dt_proj.bias).transpose(1, 2)
    else:
        dt = mixer.dt_proj.weight @ dt.transpose(1, 2)  # (b, d_inner, T)
    A = -torch.exp(mixer.A_log.float())
    bias = mixer.dt_proj.bias.float() if mixer.dt_proj.bias is not None else None
    y, last = selective_scan(x, dt, A, B, C, D=mixer.D.float(), z=gate, dt_bias=bias, initial_state=state)
    cache.update_recurrent_state(last, layer)
    return mixer.out_proj(y.transpose(1, 2).to(dtype))


def mamba1_mixer(layer: torch.nn.Module) -> torch.nn.Module | None:
    """The Mamba-1 mixer of a decoder layer (`mixer` of Mamba and Falcon-Mamba blocks, `mamba` of Jamba's), or None."""
    for name in ("mixer", "mamba"):
        mixer = getattr(layer, name, None)
        if isinstance(mixer, _MIXERS):
            return mixer
    return None


@contextmanager
def mamba1_mixers(layers: Iterable[torch.nn.Module]) -> Iterator[None]:
    """Within the block, the Mamba-1 mixers of `layers` run `mamba1_forward`; other layers are left as they are, and
    a mixer already swapped (a nested block) is left to the outer block."""
    swapped = []
    for layer in layers:
        mixer = mamba1_mixer(layer)
        if mixer is not None and "forward" not in vars(mixer):
            mixer.forward = functools.partial(mamba1_forward, mixer)
            swapped.append(mixer)
    try:
        yield
    finally:
        for mixer in swapped:
            del mixer.forward
