"""What the core needs of a context-parallel group: the prompt state split along the sequence over C ranks.

The core (attention, the prompt state, the exact plan, `backward_group`) speaks to a group only through this
protocol; `distributed.context.ContextParallel` implements it with torch.distributed collectives, so nothing in
the core imports `distributed/`. docs/design.md §9 describes the scheme: every rank runs every segment, rank r keeps
the attention parts of its own contiguous slice of capture chunks, attention partials are merged by log-sum-exp."""

from __future__ import annotations

from typing import Protocol

import torch


class ContextShards(Protocol):
    """A context-parallel group as the core uses it (implemented by `distributed.context.ContextParallel`)."""

    def owner(self, chunk: int, num_chunks: int) -> int:
        """The rank that keeps capture chunk `chunk` of `num_chunks`."""

    def owns(self, chunk: int, num_chunks: int) -> bool:
        """Whether this rank keeps that chunk's attention parts."""

    def reduce_grad(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward; the gradient summed over the group's ranks backward."""

    def merge(self, out: torch.Tensor | None, lse: torch.Tensor | None, like_out: torch.Tensor,
              like_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's partial attention (out (N, M, D), lse (N, M); None: no chunks here) merged exactly."""

    def broadcast_from(self, tensors: list[torch.Tensor | None], like: list[torch.Tensor],
                       src: int) -> list[torch.Tensor]:
        """Rank `src`'s tensors (None: zeros) on every rank, shaped like `like`."""

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` stacked in rank order, (C, *x.shape), on every rank (the sampler's environment check)."""

    def check_supported(self, model: torch.nn.Module) -> None:
        """Raise ValueError, saying what to change, if `model` has layers the sharded state does not cover."""
