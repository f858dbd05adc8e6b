"""Log-probs through an output projection split by vocabulary over a tensor-parallel group, never gathering the logits.

A model sharded with transformers' tensor-parallel plan holds its output projection as a DTensor `Shard(0)` over
the vocabulary: rank t of T keeps rows [t * ceil(V / T), ...) of the weight (and of its bias). Every rank holds the
same hidden states (the decoder's output is replicated), so each computes its own block of logits (N, V_t) and the
softmax is completed with three reductions per token chunk, all of N numbers:

  m = max over ranks of the local maxima;  S = Σ over ranks of Σ exp(logit - m);  lse = m + log S;
  logit[target] = Σ over ranks of (the local logit where the rank holds the target, else 0).

Backward: d logits_t = onehot(target)_t - exp(logits_t - lse) is local to each rank; the weight's (and bias')
gradient is the rank's own shard; the hidden states' gradient is the sum of every rank's d logits_t @ W_t (one
all-reduce of (N, d) per call), so everything upstream sees the full gradient on every rank.

`vocab_parallel_logprobs` is the fast path; `logprobs.naive_logprobs` on the gathered weight is the plain reference
the parity test compares it with (tests/distributed/test_tp_logprobs.py). `gathered_logits` is what the sampler
uses: it needs the full (G, V) distribution of one position per sequence anyway, so it all-gathers G x V logits."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from longstraw.engine.logits import chunked_backward, scored_block
from longstraw.engine.precision import accumulated_product, accumulation_dtype


def vocab_shard(weight: DTensor) -> tuple[torch.Tensor, dist.ProcessGroup, int]:
    """(local rows (V_t, d), the tensor-parallel group, the first vocabulary id of those rows) of an output
    projection sharded by vocabulary; ValueError for any other DTensor layout."""
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(
            f"the output projection is a DTensor with placements {placements} on a {mesh.ndim}-D mesh; LongStraw's "
            "log-probs take it split by vocabulary over one tensor-parallel mesh dimension (Shard(0), transformers' "
            "'colwise' / 'colwise_gather_output' plan for lm_head), or a plain tensor"
        )
    group = mesh.get_group()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    local = weight.to_local()
    vocab = weight.shape[0]
    per = -(-vocab // size)  # torch.chunk's split, which Shard(0) uses: ceil(V / T) rows, the last rank fewer
    start = min(rank * per, vocab)
    if local.shape[0] != min(per, vocab - start):
        raise ValueError(f"rank {rank}'s vocabulary shard has {local.shape[0]} rows, expected "
                         f"{min(per, vocab - start)} of {vocab} split in {size} (an uneven Shard(0) layout)")
    return local, group, start


def local_head(weight: DTensor, bias: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor | None, dist.ProcessGroup, int]:
    """This rank's rows of an output projection split by vocabulary (`vocab_shard`) and of its bias (a DTensor
    split alike, or a full (V,) tensor), the group, and the first vocabulary id of those rows."""
    local, group, start = vocab_shard(weight)
    local_bias = None
    if bias is not None:
        local_bias = vocab_shard(bias)[0] if isinstance(bias, DTensor) else bias[start : start + local.shape[0]]
    return local, local_bias, group, start


def reduced_lse_and_target(logits: torch.Tensor, targets: torch.Tensor, start: int,
                           group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (c, V_t) of this rank, targets (c,) global ids -> (lse (c,), target logit (c,)) over the whole
    vocabulary: a MAX then a SUM all-reduce of c numbers each (the SUM carries the exp-sums and the target logits)."""
    width = logits.shape[1]
    if width:
        top = logits.amax(dim=-1)
    else:  # a rank without vocabulary rows (V < T * ceil(V / T)): weighs nothing
        top = torch.full(logits.shape[:1], torch.finfo(logits.dtype).min, dtype=logits.dtype, device=logits.device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    owned = (targets >= start) & (targets < start + width)  # (c,)
    picked = torch.zeros_like(top)
    if width:
        local = (targets - start).clamp(0, width - 1)
        picked = torch.where(owned, logits.gather(1, local[:, None]).squeeze(1), picked)
    sums = torch.stack([torch.exp(logits - top[:, None]).sum(-1), picked])  # (2, c)
    dist.all_reduce(sums, group=group)
    return top + sums[0].log(), sums[1]


class _VocabParallelLogprobs(torch.autograd.Function):
    """hidden (N, d) replicated, weight (V_t, d) and bias (V_t,) or None this rank's rows starting at `start`,
    targets (N,) global ids -> logp (N,) over the whole vocabulary (the scoring of `logprobs._ChunkedLogprobs`)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                token_chunk: int, temperature: float, logit_scale: float, softcap: float | None,
                group: dist.ProcessGroup, start: int):
        out = torch.empty(hidden.shape[0], dtype=accumulation_dtype(hidden.dtype), device=hidden.device)
        lse = torch.empty_like(out)
        for s in range(0, hidden.shape[0], token_chunk):
            logits, _ = scored_block(hidden[s : s + token_chunk], weight, bias, logit_scale, temperature, softcap)
            chunk_lse, picked = reduced_lse_and_target(logits, targets[s : s + token_chunk], start, group)
            lse[s : s + token_chunk] = chunk_lse
            out[s : s + token_chunk] = picked - chunk_lse
        ctx.token_chunk, ctx.temperature, ctx.logit_scale, ctx.softcap = token_chunk, temperature, logit_scale, softcap
        ctx.group, ctx.start, ctx.has_bias = group, start, bias is not None
        ctx.save_for_backward(hidden, weight, bias if bias is not None else weight.new_empty(0), targets, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        # the softmax from the forward's global lse; the one-hot on the rank that holds the target
        d_hidden, d_weight, d_bias = chunked_backward(ctx, grad_out, ctx.start)
        if d_hidden is not None:
            dist.all_reduce(d_hidden, group=ctx.group)
        return d_hidden, d_weight, d_bias, None, None, None, None, None, None, None


def vocab_parallel_logprobs(hidden: torch.Tensor, weight: DTensor, targets: torch.Tensor, token_chunk: int,
                            temperature: float = 1.0, logit_scale: float = 1.0, softcap: float | None = None,
                            bias: torch.Tensor | None = None) -> torch.Tensor:
    """hidden (N, d) (the same on every rank of the group), weight a DTensor (V, d) sharded Shard(0) over the
    tensor-parallel mesh, targets (N,), bias (V,) sharded alike or None -> log-probs (N,), equal on every rank, of
    the scoring `logprobs.chunked_logprobs` defines. Differentiable in hidden (full gradient on every rank), the
    weight and the bias (their local shards). Every rank of the group must call it with the same N and chunking."""
    local, local_bias, group, start = local_head(weight, bias)
    return _VocabParallelLogprobs.apply(hidden, local, local_bias, targets, token_chunk, temperature, logit_scale,
                                        softcap, group, start)


def gathered_logits(h: torch.Tensor, weight: DTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """h (c, d) @ weight (V, d)^T (+ bias) with the weight sharded by vocabulary -> the full (c, V) logits on every
    rank, in the accumulation dtype (all-gather of each rank's (c, V_t) block; no gradient: the sampler's path)."""
    local, local_bias, group, start = local_head(weight, bias)
    with torch.no_grad():
        block = accumulated_product(h.detach(), local.detach(), None if local_bias is None else local_bias.detach())
        size = dist.get_world_size(group)
        per = -(-weight.shape[0] // size)
        padded = torch.zeros(block.shape[0], per, dtype=block.dtype, device=block.device)
        padded[:, : block.shape[1]] = block
        parts = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat(parts, dim=1)[:, : weight.shape[0]]
