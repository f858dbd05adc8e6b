"""The output projection, the log-probs and the loss in one chunked pass: each block of logits is formed once.

`linear_loss(hidden, weight, targets, keep, loss_of, token_level)` returns `loss_of`'s value on the log-probs of the
`keep` positions and those log-probs. Per block of `token_chunk` kept rows the forward forms the scored projection
(`logits.scored_block`: bias, logit scale, soft-cap, temperature), the log-sum-exp and the log-probs; for a token-level
loss (a term reads its own log-prob only) g = ∂loss/∂logp by autograd through `loss_of` on the log-prob vector, then
from the same logits d logits = g (onehot − softmax) and the block's share of the gradients of the hidden states, the
weight (V, d; in a walk's `GradBuffers` buffer when given) and the bias. The backward scales these stored gradients:
no block is formed again, where the reference (`logprobs.selected_logprobs`, the loss, autograd) forms each twice. A
sequence-level loss (the sequence ratio, vespo's weight) needs every log-prob before any g: its blocks run twice, as
the reference's do. A projection split by vocabulary over a tensor-parallel group (a DTensor) runs the same pass on
each rank's rows, the log-sum-exp and target logit reduced over the group (`tp_logprobs`), the hidden states' gradient
summed. The parity test: tests/engine/test_linear_loss.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from longstraw.engine.grad_buffers import GradBuffers
from longstraw.engine.logits import accumulate_block, logits_gradient, scored_block, softmax_gradient
from longstraw.engine.logprobs import DEFAULT_TOKEN_CHUNK, check_softcap, selected_logprobs
from longstraw.engine.precision import accumulation_dtype, head_input

LossOf = Callable[[torch.Tensor], "torch.Tensor | None"]


@dataclass
class _Pass:
    """What the pass needs besides its tensors; `empty` is set when `loss_of` has no term (returns None)."""

    loss_of: LossOf  # log-probs (n,) of the kept rows -> the loss, or None
    token_level: bool
    token_chunk: int
    temperature: float
    logit_scale: float
    softcap: float | None
    group: object | None = None  # the tensor-parallel process group of a vocabulary-split weight
    start: int = 0  # the first vocabulary id of this rank's rows
    empty: bool = False
    buffers: GradBuffers | None = None  # where the weight's gradient is formed (a new tensor without)

    def score(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """h (c, d), targets (c,) -> the softmax (c, V), the soft-cap's slope or None, lse (c,), logp (c,). The
        softmax is formed in place of the logits (no second (c, V) block beside the weight's gradient)."""
        logits, slope = scored_block(h, weight, bias, self.logit_scale, self.temperature, self.softcap)
        if self.group is None:
            top = logits.amax(dim=-1)  # (c,)
            picked = logits.gather(1, targets[:, None]).squeeze(1) - top
            probs = logits.sub_(top[:, None]).exp_()  # exp(logits − max), in place
            total = probs.sum(dim=-1)
            probs.div_(total[:, None])
            log_total = total.log()
            return probs, slope, top + log_total, picked - log_total
        from longstraw.engine.tp_logprobs import reduced_lse_and_target

        lse, picked = reduced_lse_and_target(logits, targets, self.start, self.group)  # type: ignore[arg-type]
        return logits.sub_(lse[:, None]).exp_(), slope, lse, picked - lse

    def gradient(self, logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """loss_of's value at `logp` (n,) and its gradient (n,) with respect to it (zeros without a term)."""
        with torch.enable_grad():
            probe = logp.detach().clone().requires_grad_()
            value = self.loss_of(probe)
            if value is None:
                self.empty = True
                return torch.zeros((), dtype=logp.dtype, device=logp.device), torch.zeros_like(logp)
            if not value.requires_grad:
                return value.detach(), torch.zeros_like(logp)
            (g,) = torch.autograd.grad(value, probe)
        return value.detach(), g


class _LinearLoss(torch.autograd.Function):
    """hidden (n, d) kept rows, weight (V, d), bias (V,) or None, targets (n,) -> (loss, logp (n,)): the loss
    differentiable in hidden, weight and bias; logp not differentiable."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                run: _Pass):
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        c, n = run.token_chunk, hidden.shape[0]
        logp = torch.zeros(n, dtype=accumulation_dtype(hidden.dtype), device=hidden.device)
        d_hidden = torch.empty_like(hidden) if need_h else None
        # Written by the first block (`accumulate_block`), so neither is zero-filled; zeroed below if no block runs.
        d_weight = (None if not need_w else run.buffers.take(weight) if run.buffers is not None
                    else torch.empty_like(weight, memory_format=torch.contiguous_format))
        d_bias = torch.empty_like(bias) if need_b and bias is not None else None
        blocks = range(0, n, c)
        value = None
        if run.token_level:
            for s in blocks:
                h, tgt = hidden[s : s + c], targets[s : s + c]
                probs, slope, _, logp[s : s + c] = run.score(h, weight, bias, tgt)
                value, g = run.gradient(logp)  # exact at rows < s + c: their terms read their own log-probs
                d_logits = softmax_gradient(probs, slope, tgt, g[s : s + c], run.temperature, run.logit_scale,
                                            run.start)
                accumulate_block(d_logits.to(weight.dtype), h, weight, s, d_hidden, d_weight, d_bias, s == 0)
                del probs, slope, d_logits  # freed before the next block's logits: one (c, V) block at a time
        else:
            lses = []
            for s in blocks:  # every log-prob first: each g reads its whole row
                _, _, lse, logp[s : s + c] = run.score(hidden[s : s + c], weight, bias, targets[s : s + c])
                lses.append(lse)
            value, g = run.gradient(logp)
            for s, lse in zip(blocks, lses):
                h, tgt = hidden[s : s + c], targets[s : s + c]
                logits, slope = scored_block(h, weight, bias, run.logit_scale, run.temperature, run.softcap)
                d_logits = logits_gradient(logits, slope, lse, tgt, g[s : s + c], run.temperature,
                                           run.logit_scale, run.start)
                accumulate_block(d_logits.to(weight.dtype), h, weight, s, d_hidden, d_weight, d_bias, s == 0)
                del logits, slope, d_logits
        if value is None:  # no kept row
            value, _ = run.gradient(logp)
        for grad in (d_weight, d_bias) if n == 0 else ():  # no block wrote them
            if grad is not None:
                grad.zero_()
        if run.group is not None and d_hidden is not None:
            import torch.distributed as dist

            dist.all_reduce(d_hidden, group=run.group)  # each rank's vocabulary share
        ctx.grads = (d_hidden, d_weight, d_bias)
        ctx.weight, ctx.buffers = weight, run.buffers
        ctx.mark_non_differentiable(logp)
        return value, logp

    @staticmethod
    def backward(ctx, grad_value: torch.Tensor, grad_logp: torch.Tensor):
        grads, weight, buffers = ctx.grads, ctx.weight, ctx.buffers
        del ctx.grads, ctx.weight, ctx.buffers  # a second backward through this pass is an error, as for a freed graph
        for t in grads:
            if t is not None:
                t.mul_(grad_value.to(t.dtype))
        if buffers is not None and grads[1] is not None:
            buffers.give(weight, grads[1])
        return (*grads, None, None)


def linear_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor, loss_of: LossOf,
    token_level: bool, token_chunk: int = DEFAULT_TOKEN_CHUNK, temperature: float = 1.0, logit_scale: float = 1.0,
    softcap: float | None = None, bias: torch.Tensor | None = None, buffers: GradBuffers | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """hidden (..., d), weight (V, d), targets (...), keep (...) bool; loss_of: log-probs (...) (0 off keep) -> the
    loss (a scalar, differentiable in its argument) or None; token_level: whether each token's term reads its own
    log-prob only. Returns (loss_of's value, differentiable in hidden, weight and bias, or None; the log-probs (...),
    detached, 0 off keep). buffers: where the weight's gradient is formed. Without grad (or nothing that needs one)
    it is `selected_logprobs` then `loss_of`."""
    check_softcap(softcap)
    shape = targets.shape
    hidden = head_input(hidden, weight)
    rows = keep.reshape(-1).nonzero().squeeze(1)  # (n,)

    def spread(kept: torch.Tensor) -> torch.Tensor:
        """The kept rows' values (n,) in place, 0 elsewhere -> (...)."""
        full = torch.zeros(targets.numel(), dtype=kept.dtype, device=kept.device)
        return full.index_copy(0, rows, kept).view(shape)

    needs = [t for t in (hidden, weight, bias) if t is not None and t.requires_grad]
    if not torch.is_grad_enabled() or not needs:
        logp = selected_logprobs(hidden, weight, targets, keep, token_chunk, temperature, logit_scale, softcap=softcap,
                                 bias=bias)
        return loss_of(logp), logp
    run = _Pass(lambda kept: loss_of(spread(kept)), token_level, token_chunk, temperature, logit_scale, softcap,
                buffers=buffers)
    local, local_bias = weight, bias
    if isinstance(weight, DTensor):  # split by vocabulary over a tensor-parallel group
        from longstraw.engine.tp_logprobs import local_head

        local, local_bias, run.group, run.start = local_head(weight, bias)
    kept_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)  # (n, d)
    value, logp = _LinearLoss.apply(kept_hidden, local, local_bias, targets.reshape(-1).index_select(0, rows), run)
    return (None if run.empty else value), spread(logp)
