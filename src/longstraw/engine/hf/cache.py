"""`SegmentCache`: the cache object a transformers model sees while we run a segment over a prompt state.

transformers' decoder layers talk to their cache through a handful of methods (`update` for attention K/V or MLA
latents, `update_indexer` for DSA, `get/update_conv_state` and `get/update_recurrent_state` for linear attention and
SSM layers). Its own cache layers update recurrent and conv states **in place** and concatenate K/V into new tensors;
both are wrong for us (docs/design.md §4, traps): one replay would advance the state another replay then reads,
autograd fails on the in-place writes, and the concatenation copies the whole prompt K/V.

This object answers the same calls functionally, for one segment (a capture chunk, a replayed micro-batch, or one
decoding step), over a fork of the shared `PromptState`:

* `update` returns the segment's own K/V (or latents) unchanged: the attention kernel (`segment.py`) reads the
  prompt's chunks from the state itself. During sampling it appends to the rollout's `ResponseState`.
* `get_conv_state` / `get_recurrent_state` hand out a fresh batch-expanded *clone* of the prompt's state (KB–MB,
  never the K/V), which a layer may write into in place; `update_*` return new tensors and never write the state.
* What every layer produced is put in `collect`; with `kv_only` the forward stops once every layer's state is in.

transformers 5.5-5.20 ask for conv/recurrent state another way: `has_previous_state(layer)`, then
`layers[layer].conv_states` / `.recurrent_states` (one tensor each up to 5.13, a list of them from 5.14), with
`layers[layer].record_past` (5.16-5.20) choosing the functional conv path; `has_previous_state` and `layers` answer
those from the same fork (which model types this makes exact on which release: `architecture.
MIN_TRANSFORMERS_BY_MODEL_TYPE`). Whatever the release, `check_asked` refuses a forward in which a layer that holds
prompt state never asked for it, instead of returning a result computed without the prompt."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import transformers

from longstraw.engine.state.prompt import Collected, PromptState
from longstraw.engine.state.response import ResponseState


class StateCollected(Exception):
    """Raised inside the model once every layer's state parts are collected (`kv_only`)."""


@functools.cache
def _one_state_per_layer() -> bool:
    """Whether this transformers' linear-attention cache layers hold one conv and one recurrent tensor (releases
    up to 5.13; later ones hold a list of them, indexed by `state_idx`), read from its cache layer's signature."""
    mixin = getattr(transformers.cache_utils, "LinearAttentionCacheLayerMixin", None)
    return mixin is not None and "state_idx" not in inspect.signature(mixin.update_conv_state).parameters


class _LayerStates:
    """`cache.layers[i]` as transformers 5.5-5.20 read it: the layer's conv and recurrent state (the one handed out
    in this segment, else a fresh clone of the fork's), its device, and `record_past`."""

    record_past = True  # 5.16-5.20: one token takes `update_conv_state` too, never the in-place conv kernel

    def __init__(self, cache: SegmentCache, index: int) -> None:
        self._cache, self._index = cache, index

    def _read(self, part: str) -> torch.Tensor | list[torch.Tensor] | None:
        tensor = self._cache.handed_out.get((part, self._index))
        if tensor is None:
            tensor = self._cache._hand_out(part, self._index)
        if tensor is None or _one_state_per_layer():
            return tensor
        return [tensor]

    @property
    def conv_states(self) -> torch.Tensor | list[torch.Tensor] | None:
        return self._read("conv")

    @property
    def recurrent_states(self) -> torch.Tensor | list[torch.Tensor] | None:
        return self._read("recurrent")

    @property
    def device(self) -> torch.device:  # read by Mamba2's one-token path, which runs only on a layer with state
        current = self._cache._current("recurrent", self._index)
        if current is None:
            raise RuntimeError(f"layer {self._index} asked for its state's device but holds no recurrent state")
        return current.device


class SegmentCache:
    """Cache protocol for one segment of `batch` sequences at positions start … start+T-1."""

    def __init__(self, state: PromptState, start: int, batch: int, collect: Collected | None = None,
                 generated: ResponseState | None = None, kv_only: bool = False) -> None:
        if kv_only and collect is None:
            raise ValueError("kv_only needs a collect dict to put the state in")
        self.state, self.start, self.batch = state, start, batch
        self.collect, self.generated, self.kv_only = collect, generated, kv_only
        self.handed_out: dict[tuple[str, int], torch.Tensor] = {}  # recurrent parts given to a layer
        # Activation checkpointing (activation_checkpointing.py): what each layer had been handed when it first ran, and
        # whether a layer is being recomputed in the backward (then nothing is collected again).
        self._entry: dict[int, dict[tuple[str, int], torch.Tensor]] = {}
        self.recomputing = False
        self.asked: dict[int, set[str]] = {}  # per layer, the state parts it asked for (`check_asked`)
        # The layer index of the last `update` call: the attention kernel reads that layer's prompt K/V when its module
        # has no index of its own (Zamba2's shared attention blocks, `layer_idx` -1, are told the calling layer's).
        self.attending: int | None = None

    # --- bookkeeping --------------------------------------------------------------------------------------
    @contextmanager
    def layer(self, index: int, recompute: bool) -> Iterator[None]:
        """Run decoder layer `index` for the first time, or again as a checkpointing recompute, which starts from the
        recurrent parts the layer held when it first ran and collects nothing (no second `kv_only` stop)."""
        if recompute:
            self._restore_entry(index)
        else:
            self._entry[index] = {k: t for k, t in self.handed_out.items() if k[1] == index}
        self.recomputing = recompute
        try:
            yield
        finally:
            self.recomputing = False
            if recompute:
                # Drop what the recompute handed out and produced: a recurrent layer's final state is not on the
                # backward's path, so its recomputed graph (and the activations refilled into it) would otherwise
                # stay alive through this cache, which the checkpoint keeps until the whole backward ends.
                self._restore_entry(index)

    def _restore_entry(self, index: int) -> None:
        """Layer `index`'s handed-out recurrent parts back to those it held when it first ran."""
        for key in [k for k in self.handed_out if k[1] == index]:
            del self.handed_out[key]
        self.handed_out.update(self._entry.get(index, {}))

    def _asked(self, layer: int, *parts: str) -> None:
        self.asked.setdefault(layer, set()).update(parts)

    def check_asked(self, model_type: str) -> None:
        """Raise unless every layer that holds a prompt state part asked the cache for it in this forward (`update`,
        `update_indexer`, the conv and recurrent state): a layer that never asked ran without the prompt."""
        needed = self.state.layer_parts
        if needed is None or (self.state.length == 0 and self.generated is None):
            return
        missing = {}
        for layer, parts in enumerate(needed):
            want = {"key" if part == "value" else part for part in parts} - self.asked.get(layer, set())
            if want:
                missing[layer] = sorted(want)
        if missing:
            shown = "; ".join(f"layer {layer}: {', '.join(parts)}" for layer, parts in list(missing.items())[:4])
            raise RuntimeError(
                f"{model_type} on transformers {transformers.__version__}: layers that hold prompt state never asked "
                f"LongStraw's cache for it ({shown}), so their output would silently ignore the prompt. This "
                "transformers passes the cache or its state another way than LongStraw speaks: install the one "
                "constraints.txt pins, or a release architecture.MIN_TRANSFORMERS_BY_MODEL_TYPE allows")

    def _record(self, layer: int, part: str, tensor: torch.Tensor) -> None:
        if self.collect is None or self.recomputing:
            return
        self.collect.setdefault(layer, {})[part] = tensor
        needed = self.state.layer_parts
        if self.kv_only and needed is not None and all(
            needed[layer_].issubset(self.collect.get(layer_, {})) for layer_ in range(self.state.num_layers)
        ):
            raise StateCollected

    def note_window(self, layer: int, window: int | None) -> None:
        """The attention kernel reports each layer's sliding window, so the state can drop what is outside it."""
        if self.collect is not None and window is not None and not self.recomputing:
            # An int in the dict of tensors (Collected): `PromptState.append_chunk` pops it before it reads the rest.
            self.collect.setdefault(layer, {})["window"] = window  # type: ignore[assignment]

    def finish(self) -> None:
        """After the forward: recurrent parts a layer updated in place (single-token kernels skip `update_*`)
        are collected from the clones it was handed."""
        for (part, layer), tensor in self.handed_out.items():
            if self.collect is not None and part not in self.collect.get(layer, {}):
                self.collect.setdefault(layer, {})[part] = tensor

    def _expand(self, t: torch.Tensor) -> torch.Tensor:
        return t.expand(self.batch, *t.shape[1:])

    # --- attention ----------------------------------------------------------------------------------------
    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Attention layers: this segment's K/V (B, Hkv, T, D) or MLA latents (B, 1, T, d), returned unchanged, or
        with every generated token's while decoding."""
        self._asked(layer_idx, "key")
        self.attending = layer_idx
        self._record(layer_idx, "key", key)
        self._record(layer_idx, "value", value)
        if self.generated is not None:
            return self.generated.append_kv(layer_idx, key, value)
        return key, value

    def update_indexer(self, index_key: torch.Tensor, layer_idx: int, *args, **kwargs) -> torch.Tensor:
        """DSA indexer keys (B, T, d_I) -> keys of [prompt ; earlier generated ; this segment] (B, P'+S, d_I): a
        transient copy of the prompt's (d_I numbers per position, no grad, one layer at a time), as the reference's own
        cache makes, since transformers' indexer scores one key tensor."""
        self._asked(layer_idx, "index")
        self._record(layer_idx, "index", index_key)
        own = self.generated.append_index(layer_idx, index_key) if self.generated is not None else index_key
        prompt = self.state.index_keys(layer_idx)
        return own if prompt is None else torch.cat([self._expand(prompt.to(own.dtype)), own], dim=1)

    # --- linear attention / SSM ---------------------------------------------------------------------------
    def _current(self, part: str, layer: int, expand: bool = True) -> torch.Tensor | None:
        if self.generated is not None and self.generated.has(part, layer):
            return self.generated.get(part, layer)
        prompt = self.state.last(part, layer)
        return self._expand(prompt) if prompt is not None and expand else prompt

    def _hand_out(self, part: str, layer: int) -> torch.Tensor | None:
        self._asked(layer, part)
        current = self._current(part, layer)
        if current is None:
            return None
        fresh = current.clone()  # differentiable; a layer may write into it in place
        self.handed_out[(part, layer)] = fresh
        return fresh

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._hand_out("conv", layer_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._hand_out("recurrent", layer_idx)

    def read_recurrent_state(self, layer_idx: int) -> torch.Tensor | None:
        """The recurrent state this segment continues, not copied: the prompt's (1, ...), shared by every row, or
        while decoding the rollout's (B, ...). For a kernel that never writes into it (`engine.hf.mamba1`)."""
        self._asked(layer_idx, "recurrent")
        return self._current("recurrent", layer_idx, expand=False)

    def update_conv_state(self, inputs: torch.Tensor, layer_idx: int, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        """inputs (B, C, T) -> [previous conv window ; inputs] (B, C, K+T) for the causal conv to read. The new window
        is the last K columns, zero-padded on the left while fewer than K tokens exist (the conv's own zero padding).
        transformers 5.16-5.20 call this without asking for the conv state first: the fork's is taken. Up to 5.14 a
        layer passes [its conv state ; inputs] already cut to the last K columns: the window kept is then those."""
        previous = self.handed_out.get(("conv", layer_idx))
        if previous is None:
            previous = self._hand_out("conv", layer_idx)
        full = inputs if previous is None else torch.cat([previous.to(inputs.dtype), inputs], dim=-1)
        k = conv_kernel_size or (previous.shape[-1] if previous is not None else full.shape[-1])
        # A copy, not a view: a view would keep the whole (B, C, K+T) input alive for as long as the window is
        # held (the segment, or with checkpointing the whole backward), where only K columns are needed.
        window = full[..., -k:].clone()
        if window.shape[-1] < k:
            window = torch.nn.functional.pad(window, (k - window.shape[-1], 0))
        self.handed_out[("conv", layer_idx)] = window
        self._record(layer_idx, "conv", window)
        return full

    def update_recurrent_state(self, recurrent: torch.Tensor, layer_idx: int, state_idx: int = 0,
                               **kwargs) -> torch.Tensor:
        if recurrent.untyped_storage().nbytes() > recurrent.numel() * recurrent.element_size():
            recurrent = recurrent.clone()  # Mamba2's final state is a view of all its scan's chunk states
        self.handed_out[("recurrent", layer_idx)] = recurrent
        self._record(layer_idx, "recurrent", recurrent)
        return recurrent

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """MiniMax's lightning attention: the K^T V state (B, H, d, d) the segment continues (None: no prompt yet, and
        the layer runs its block path from zero). Kept as the layer's `recurrent` part."""
        return self._hand_out("recurrent", layer_idx)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        """MiniMax's lightning attention: its state after the segment (a new tensor; the layer writes none in place)."""
        self.update_recurrent_state(linear_cache, layer_idx)

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        """True makes conv layers take the functional `update_conv_state` path even for one token."""
        return True

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """transformers 5.5-5.20: whether `layer_idx` (any layer: None) continues a conv/recurrent state."""
        if layer_idx is None:
            return self.start > 0
        generated = self.generated is not None and self.generated.has("recurrent", layer_idx)
        return generated or bool(self.state.parts["recurrent"][layer_idx])

    @property
    def layers(self) -> list[_LayerStates]:
        """transformers 5.5-5.20: `layers[i].conv_states` and `.recurrent_states` (`_LayerStates`)."""
        return [_LayerStates(self, i) for i in range(self.state.num_layers)]

    # --- what model code may ask --------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start

    def __len__(self) -> int:
        return self.state.num_layers
