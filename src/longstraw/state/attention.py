"""Prompt state of full-attention layers (GQA/MQA): the K/V of every prompt token, per layer, in chunks.

The state is stored as the chunks the capture produced, never concatenated: replays read them in place
(`attention.prefix_attention` walks the chunk list), the exact plan's reverse prompt backward needs exactly
these chunk boundaries, and a fork is just a new list of the same tensors (no copy of K/V).

Per layer and token: 2 * Hkv * D * bytes (DESIGN §4). Shapes: each chunk is (1, Hkv, c, D), keys after RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVState:
    """K/V chunks of the prompt for every layer. `keys[l][j]` is chunk j of layer l, shape (1, Hkv, c_j, D)."""

    num_layers: int
    keys: list[list[torch.Tensor]] = field(default_factory=list)
    values: list[list[torch.Tensor]] = field(default_factory=list)
    bounds: list[tuple[int, int]] = field(default_factory=list)  # [start, end) token range of each chunk

    def __post_init__(self) -> None:
        if not self.keys:
            self.keys = [[] for _ in range(self.num_layers)]
            self.values = [[] for _ in range(self.num_layers)]

    @property
    def length(self) -> int:
        """Number of prompt positions held."""
        return self.bounds[-1][1] if self.bounds else 0

    @property
    def num_chunks(self) -> int:
        return len(self.bounds)

    def append_chunk(self, start: int, end: int, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Add the K/V one chunk [start, end) produced in every layer (`kv[layer] = (k, v)`)."""
        if start != self.length:
            raise RuntimeError(f"chunk starts at {start} but the state holds {self.length} positions")
        if sorted(kv) != list(range(self.num_layers)):
            raise RuntimeError(f"chunk produced K/V for layers {sorted(kv)}, expected all {self.num_layers}")
        for layer, (k, v) in kv.items():
            self.keys[layer].append(k)
            self.values[layer].append(v)
        self.bounds.append((start, end))

    def prefix(self, num_chunks: int) -> KVState:
        """A fork holding the first `num_chunks` chunks: new lists, the same tensors (no copy)."""
        return KVState(
            num_layers=self.num_layers,
            keys=[list(ks[:num_chunks]) for ks in self.keys],
            values=[list(vs[:num_chunks]) for vs in self.values],
            bounds=list(self.bounds[:num_chunks]),
        )

    def fork(self) -> KVState:
        """A view for one replay. Replays never write into it, so sharing the tensors is safe."""
        return self.prefix(self.num_chunks)

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.keys + self.values for t in layer]

    def chunk_tensors(self, j: int) -> list[torch.Tensor]:
        """Keys then values of chunk j, layer by layer."""
        return [ks[j] for ks in self.keys] + [vs[j] for vs in self.values]

    def as_leaves(self) -> KVState:
        """The same state as leaf tensors that require grad (the exact plan collects dL/dK, dL/dV in .grad).

        `detach()` shares storage, so no K/V is copied.
        """
        leaf = lambda t: t.detach().requires_grad_(True)  # noqa: E731
        return KVState(
            num_layers=self.num_layers,
            keys=[[leaf(t) for t in ks] for ks in self.keys],
            values=[[leaf(t) for t in vs] for vs in self.values],
            bounds=list(self.bounds),
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @staticmethod
    def expected_nbytes(num_layers: int, kv_heads: int, head_dim: int, positions: int, dtype: torch.dtype) -> int:
        """DESIGN §4 formula: 2 * Hkv * D * bytes per token per layer."""
        return 2 * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size() * positions * num_layers


class ResponseKV:
    """Per-sequence K/V of tokens generated so far, for sampling (no grad): preallocated, written in place.

    keys[l] / values[l]: (B, Hkv, max_len, D); `length` positions are filled. Unlike the prompt state, this
    buffer belongs to one rollout and is never shared, so in-place writes are safe here.
    """

    def __init__(self, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's K/V (B, Hkv, T, D) after the filled part; return all filled K/V of the layer."""
        t = key.shape[2]
        end = self.length + t
        if end > self.keys[layer].shape[2]:
            raise RuntimeError(f"response buffer full: {end} > {self.keys[layer].shape[2]} positions")
        self.keys[layer][:, :, self.length : end] = key
        self.values[layer][:, :, self.length : end] = value
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, t: int) -> None:
        """Mark t more positions filled, once every layer has written them."""
        self.length += t
