"""Per-sequence state of the tokens a rollout has generated so far (sampling, no grad), free to grow and be replaced:

* attention layers: K/V (or MLA latents) of every generated token, (B, Hkv, max_len, D), preallocated on
  the first write (its shape comes from the layer) and filled in place, plus DSA indexer keys;
* recurrent layers: the current conv window and recurrent state of each sequence, replaced every step.

A row of it continues a prompt state in place (`continued`): a tree rollout's fork reads its parent's K/V in place."""

from __future__ import annotations

import torch

from longstraw.engine.state.prompt import PARTS, Collected, PromptState


class ResponseState:
    """Generated-token state for `batch` sequences of at most `max_len` tokens."""

    def __init__(self, batch: int, max_len: int) -> None:
        self.batch, self.max_len = batch, max_len
        self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.index: dict[int, torch.Tensor] = {}
        self.recurrent: dict[tuple[str, int], torch.Tensor] = {}
        self.length = 0  # generated positions filled in every layer

    def _buffer(self, like: torch.Tensor, dim: int) -> torch.Tensor:
        return like.new_empty((*like.shape[:dim], self.max_len, *like.shape[dim + 1:]))

    def _check_room(self, t: int) -> int:
        end = self.length + t
        if end > self.max_len:
            raise RuntimeError(f"response buffer full: {end} > {self.max_len} positions")
        return end

    def append_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's K/V (B, Hkv, T, D) after the filled part; return all filled K/V of the layer."""
        end = self._check_room(key.shape[2])
        if layer not in self.kv:
            self.kv[layer] = (self._buffer(key, 2), self._buffer(value, 2))
        keys, values = self.kv[layer]
        keys[:, :, self.length : end] = key
        values[:, :, self.length : end] = value
        return keys[:, :, :end], values[:, :, :end]

    def append_index(self, layer: int, index_key: torch.Tensor) -> torch.Tensor:
        """Store this step's indexer keys (B, T, d_I); return all filled ones (B, S, d_I)."""
        end = self._check_room(index_key.shape[1])
        if layer not in self.index:
            self.index[layer] = self._buffer(index_key, 1)
        self.index[layer][:, self.length : end] = index_key
        return self.index[layer][:, :end]

    def has(self, part: str, layer: int) -> bool:
        return (part, layer) in self.recurrent

    def get(self, part: str, layer: int) -> torch.Tensor:
        return self.recurrent[(part, layer)]

    def advance(self, t: int, collected: Collected) -> None:
        """Mark t more positions filled, once every layer has run, and keep the new recurrent parts."""
        self.length += t
        for layer, parts in collected.items():
            for part in ("conv", "recurrent"):
                if part in parts:
                    self.recurrent[(part, layer)] = parts[part]

    def continued(self, state: PromptState, row: int, start: int) -> PromptState:
        """`state` (positions [0, start)) continued by row `row` over [start, start + length): a new list of the same
        chunks plus one whose parts are views of this buffer (K/V, latents, indexer keys of those positions; the conv
        window and recurrent state the row holds now, after its last position). Nothing is copied."""
        n = self.length
        out = state.branch()  # new lists over the same tensors, read chunk by chunk past the prompt's slab
        for layer in range(state.num_layers):
            parts: dict[str, torch.Tensor | None] = dict.fromkeys(PARTS)
            if layer in self.kv:
                keys, values = self.kv[layer]
                parts["key"], parts["value"] = keys[row : row + 1, :, :n], values[row : row + 1, :, :n]
            if layer in self.index:
                parts["index"] = self.index[layer][row : row + 1, :n]
            for part in ("conv", "recurrent"):
                if self.has(part, layer):
                    parts[part] = self.get(part, layer)[row : row + 1]
            for name in PARTS:
                out.parts[name][layer].append(parts[name])
        out.bounds.append((start, start + n))
        return out
