"""The (V, d) weight gradients of a walk's replays without a dense tensor per backward: the input embedding's
gradient is sparse (the replay's rows only) wherever its weight has a `.grad` to add into; the output projection's
(the fused pass's, `engine/linear_loss.py`) is formed in one reused buffer. A fresh dense tensor per backward is
zero-filled and, on CPU under a fixed mmap threshold, page-faulted afresh (31 MiB on b1-llama, ~20 ms).

A buffer is handed to autograd as the weight's gradient: AccumulateGrad adds it into `.grad`, or copies it when
`.grad` is None (the pool's reference keeps it from being stolen). `take` reuses it only once nothing else references
it (`Tensor._use_count`). Only leaf weights without tensor hooks that are not DTensors take either path (`eligible`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.distributed.tensor import DTensor


def eligible(weight: torch.Tensor) -> bool:
    """Whether `weight`'s gradient goes straight to its AccumulateGrad (a leaf without tensor hooks, not split)."""
    return weight.is_leaf and weight.requires_grad and not weight._backward_hooks and not isinstance(weight, DTensor)


class GradBuffers:
    """At most one idle tensor per weight shape, taken (unset) for one backward's gradient and given back after it."""

    def __init__(self) -> None:
        self._idle: dict[tuple, torch.Tensor] = {}
        self.allocated = 0  # tensors allocated; the other takes reused one

    def take(self, weight: torch.Tensor) -> torch.Tensor:
        """A tensor like `weight`, its values unset (the caller writes every element): the idle buffer once nothing
        else references it, else a fresh one."""
        buffer = self._idle.get(_key(weight)) if eligible(weight) else None
        if buffer is not None and buffer._use_count() == 1:  # type: ignore[attr-defined]  # only the pool holds it
            del self._idle[_key(weight)]
            return buffer
        self.allocated += 1
        return torch.empty_like(weight, memory_format=torch.contiguous_format)

    def give(self, weight: torch.Tensor, buffer: torch.Tensor) -> None:
        """Keep `buffer`, which autograd now holds as `weight`'s gradient, for a later `take`."""
        if eligible(weight):
            self._idle[_key(weight)] = buffer


def _key(weight: torch.Tensor) -> tuple:
    return tuple(weight.shape), weight.dtype, weight.device


class _RowGradEmbedding(torch.autograd.Function):
    """ids (...), weight (V, d) -> weight[ids] (..., d); the weight's gradient a sparse (V, d) of the ids' rows when
    the weight has a dense `.grad` (autograd adds it in place), else dense as nn.Embedding's."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None):
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,), weight = ctx.saved_tensors, ctx.weight
        del ctx.weight
        rows = ids.reshape(-1)  # (n,)
        values = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)  # (n, d)
        if ctx.padding_idx is not None:  # F.embedding's backward leaves the padding row's gradient 0
            values = values.masked_fill((rows == ctx.padding_idx)[:, None], 0)
        if weight.grad is not None and weight.grad.layout == torch.strided:
            return None, torch.sparse_coo_tensor(rows[None], values, weight.shape, check_invariants=False), None
        return None, torch.zeros_like(weight).index_add_(0, rows, values), None


@contextmanager
def row_grad_embedding(embedding: torch.nn.Module) -> Iterator[None]:
    """While open, a plain `nn.Embedding` (no max_norm, no frequency scaling, dense) with an `eligible` weight forms
    its weight gradient by `_RowGradEmbedding` (the same output, recomputed). Any other embedding runs as it is."""
    plain = (type(embedding) is torch.nn.Embedding and embedding.max_norm is None
             and not embedding.scale_grad_by_freq and not embedding.sparse and eligible(embedding.weight))
    if not plain:
        yield
        return

    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        if not torch.is_grad_enabled():
            return None
        return _RowGradEmbedding.apply(args[0], module.weight, module.padding_idx)

    handle = embedding.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
