"""The full-attention K/V of a depth-first walk's current path (`engine/tree/plans.py`), one tensor per layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PathSlab:
    """The full-attention K/V of a depth-first walk's current path past its root (`PromptState.attach_path`): one
    (1, Hkv, capacity, D) tensor per layer and part, position p at index p − start. A node's chunks are written at
    their positions, over a sibling's whose visit ended, and every reader takes the path as one view: one kernel
    call and one autograd input, however deep the walk. `leaves` (the exact plan): each tensor is a leaf that requires
    grad, so the readers' gradients accumulate in its `.grad`, which a node's prompt backward reads at its own
    positions (`gradient`) and then zeroes (`clear`)."""

    start: int
    capacity: int
    leaves: bool
    tensors: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)

    def write(self, name: str, layer: int, start: int, end: int, part: torch.Tensor) -> torch.Tensor:
        """Store `part` (1, Hkv, end − start, D) at its positions; returns the stored view (no grad: see `gradient`)."""
        slab = self.tensors.get((name, layer))
        if slab is None:
            slab = part.new_zeros((*part.shape[:2], self.capacity, part.shape[3]))
            slab.requires_grad_(self.leaves and part.is_floating_point())
            self.tensors[(name, layer)] = slab
        if slab.shape[:2] != part.shape[:2] or slab.shape[3] != part.shape[3] or slab.dtype != part.dtype:
            raise RuntimeError(f"layer {layer} {name}: chunk of shape {tuple(part.shape)} {part.dtype}, the path's "
                               f"earlier chunks were {tuple(slab.shape)} {slab.dtype}")
        if end - self.start > self.capacity:
            raise RuntimeError(f"chunk ends at {end}, past the {self.start + self.capacity} positions of the path")
        slab.data[:, :, start - self.start: end - self.start].copy_(part.detach())  # `.data`: see `PromptState._slab`
        return slab.detach()[:, :, start - self.start: end - self.start]

    def read(self, layer: int, end: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(start, key, value) of positions start … end − 1 as (1, Hkv, end − start, D); differentiable under grad."""
        n = end - self.start
        return self.start, self.tensors[("key", layer)][:, :, :n], self.tensors[("value", layer)][:, :, :n]

    def gradient(self, name: str, layer: int, start: int, end: int) -> torch.Tensor | None:
        grad = self.tensors[(name, layer)].grad
        return None if grad is None else grad[:, :, start - self.start: end - self.start]

    def clear(self, name: str, layer: int, start: int, end: int) -> None:
        grad = self.tensors[(name, layer)].grad
        if grad is not None:
            grad[:, :, start - self.start: end - self.start].zero_()
