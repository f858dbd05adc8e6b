"""Context parallelism: the prompt state split along the sequence over C ranks (docs/distributed.md).

Design: *replicated segments, sharded state.* Every rank of the context-parallel group runs every segment (capture
chunk, replayed micro-batch, recomputed chunk of the exact plan) on the same tokens, but rank r keeps the attention
state (K/V, MLA latents, indexer keys) of its own contiguous slice of capture chunks only. In each attention layer a
rank attends its queries to its own slice and the C partial results are merged exactly by their log-sum-exps
(`ContextParallel.merge`); recurrent layers' state, constant in P, is computed by every rank. Per-rank prompt state
is ~1/C; the non-attention work of a segment is repeated on every rank.

Gradients: everything but the prompt attention is replicated, so each rank holds the *complete* parameter gradient
if the gradient of a gathered partial is the rank's own slice (every rank computed the same downstream: no
communication) and the queries' gradient sums the C partials' contributions (`reduce_grad`). The exact plan's state
gradients stay sharded: its reverse prompt backward walks the global chunks in reverse, and the owner of chunk c
broadcasts the accumulated gradient of c's K/V so every rank can backpropagate the replicated recompute of c.

Supported layer kinds: full attention (fused kernel path) and recurrent layers; `check_supported` refuses the others."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist


def all_reduced(grad: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """A copy of `grad` summed over `group` (a collective)."""
    grad = grad.contiguous().clone()
    dist.all_reduce(grad, group=group)
    return grad


def _stacked(x: torch.Tensor, size: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's `x` stacked in rank order: (size, *x.shape); contiguous, as the collective writes bytes in order."""
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    return torch.stack(parts)


class _ReduceGrad(torch.autograd.Function):
    """Identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return all_reduced(grad, ctx.group), None


class _GatherPartials(torch.autograd.Function):
    """All-gather each rank's partial (out, lse); backward keeps this rank's slice of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, lse: torch.Tensor, group, rank: int, size: int):
        ctx.rank = rank
        return _stacked(out, size, group), _stacked(lse, size, group)  # (C, ...)

    @staticmethod
    def backward(ctx, d_outs: torch.Tensor, d_lses: torch.Tensor):
        return d_outs[ctx.rank], d_lses[ctx.rank], None, None, None


class ContextParallel:
    """A context-parallel group: which capture chunks this rank owns, and the two collectives of attention.
    Implements `state.sharding.ContextShards`, the protocol through which the core uses it."""

    def __init__(self, group=None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("context parallelism needs torch.distributed initialised (launch with torchrun)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        # Models already checked: the check reads the layer kinds from a meta-device instantiation of the config
        # (0.07-0.5 s), which must not run on every `backward_group` call.
        self._supported: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

    def check_supported(self, model: torch.nn.Module) -> None:
        """`check_supported`, once per model."""
        if model not in self._supported:
            check_supported(model)
            self._supported.add(model)

    def owner(self, chunk: int, num_chunks: int) -> int:
        """Contiguous slices: chunk j of n belongs to rank floor(j * C / n) (C need not divide n)."""
        return chunk * self.size // max(num_chunks, 1)

    def owns(self, chunk: int, num_chunks: int) -> bool:
        return self.owner(chunk, num_chunks) == self.rank

    def reduce_grad(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceGrad.apply(x, self.group)

    def merge(self, out: torch.Tensor | None, lse: torch.Tensor | None, like_out: torch.Tensor,
              like_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge every rank's partial attention over its slice: out (N, M, D), lse (N, M) -> global ones. A rank without
        prompt chunks contributes (0, most negative finite), which weighs exactly 0."""
        if out is None:
            out = torch.zeros_like(like_out)
            lse = torch.full_like(like_lse, torch.finfo(like_lse.dtype).min)
        outs, lses = _GatherPartials.apply(out, lse, self.group, self.rank, self.size)
        total = torch.logsumexp(lses, dim=0)
        merged = (torch.exp(lses - total).unsqueeze(-1) * outs).sum(0)
        return merged, total

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` stacked in rank order: (C, *x.shape)."""
        return _stacked(x, self.size, self.group)

    def broadcast_from(self, tensors: list[torch.Tensor | None], like: list[torch.Tensor],
                       src: int) -> list[torch.Tensor]:
        """The owner's tensors (None → zeros) on every rank, shaped like `like`."""
        out = []
        for t, ref in zip(tensors, like):
            # Contiguous both sides: empty_like copies a transposed view's strides; collectives write bytes in order.
            if self.rank == src:
                buf = (t if t is not None else torch.zeros_like(ref)).detach().contiguous().clone()
            else:
                buf = torch.empty(ref.shape, dtype=ref.dtype, device=ref.device)
            dist.broadcast(buf, src=dist.get_global_rank(self.group, src) if self.group is not None else src,
                           group=self.group)
            out.append(buf)
        return out


def check_blocks(processes: int, cp: int, tp: int = 1) -> None:
    """Refuse a number of processes that blocks of `cp` x `tp` consecutive ranks do not divide, with what to do."""
    if cp < 1 or tp < 1:
        raise ValueError(f"--cp and --tp must be >= 1, got --cp {cp} --tp {tp}")
    if processes % (cp * tp):
        what, fix = ((f"--tp {tp} x --cp {cp}", f"a --tp that divides {processes // cp or 1}") if tp > 1 else
                     (f"--cp {cp}", f"a --cp that divides {processes}"))
        raise ValueError(f"{what} needs --nproc to be a multiple of {cp * tp}, got {processes}: use --nproc "
                         f"{cp * tp * max(1, processes // (cp * tp))} (torchrun: --nproc-per-node) or {fix}")


def context_blocks(cp: int, tp: int = 1) -> ContextParallel:
    """This rank's context-parallel group when the world's ranks are laid out as rank = (block * cp + c) * tp + t:
    the `cp` ranks of its block with its t (tp = 1: blocks of `cp` consecutive ranks). `new_group` is collective:
    every rank creates every group, and keeps its own."""
    rank, world = dist.get_rank(), dist.get_world_size()
    check_blocks(world, cp, tp)
    mine = None
    for first in range(0, world, cp * tp):
        for t in range(tp):
            members = [first + c * tp + t for c in range(cp)]
            group = dist.new_group(members)
            if rank in members:
                mine = ContextParallel(group)
    assert mine is not None
    return mine


# Families whose recurrent or shared-block state no context-parallel test has run: Zamba2's shared attention blocks,
# MiniMax's lightning attention, ZAYA's convolutional attention.
CP_UNVERIFIED_MODEL_TYPES = ("zamba2", "minimax", "zaya")


def check_supported(model: torch.nn.Module) -> None:
    """Refuse layer kinds whose attention does not run through the fused path (windows, attention chunks, MLA, DSA)."""
    from longstraw.planner import spec_from_config

    config: Any = model.config
    model_type = (getattr(config, "text_config", None) or config).model_type
    if model_type in CP_UNVERIFIED_MODEL_TYPES:
        raise ValueError(f"context parallelism has not been verified on {model_type} (shared blocks, lightning "
                         "or convolutional attention state): run it without --cp")
    unsupported = set(spec_from_config(model.config).mixers) & {"sliding", "chunked", "mla", "dsa"}
    if unsupported or getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"context parallelism supports full-attention and recurrent layers; this model has "
                         f"{sorted(unsupported)} layers: run it without --cp")
