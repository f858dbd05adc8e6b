"""A block of scored logits and its gradient, shared by every log-prob path (`logprobs`, `tp_logprobs`, `linear_loss`).

The logits scored are softcap * tanh((hidden @ weight.T + bias) * logit_scale / softcap) / temperature, in that order,
as transformers' forward forms them and the samplers then divide by the temperature (`logprobs`' module docstring)."""

from __future__ import annotations

from typing import Any

import torch

from longstraw.engine.precision import accumulated_product


def scaled_logits(logits: torch.Tensor, logit_scale: float, temperature: float,
                  softcap: float | None = None) -> torch.Tensor:
    """softcap * tanh(logits * logit_scale / softcap) / temperature, in place (the order transformers' forward and
    the sampler use; no cap when softcap is None). logits (c, V) -> (c, V)."""
    if logit_scale != 1.0:
        logits.mul_(logit_scale)
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


def scored_block(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, logit_scale: float,
                 temperature: float, softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scored logits (c, V) of h (c, d) and, with a soft-cap, its slope 1 - tanh^2 (c, V) for the logits' gradient
    (d(cap * tanh(x / cap)) / dx). weight (V, d): a plain tensor (one rank's rows under tensor parallelism)."""
    logits = scaled_logits(accumulated_product(h, weight, bias), logit_scale, 1.0)
    slope = None
    if softcap is not None:
        logits.div_(softcap).tanh_()
        slope = 1.0 - logits * logits
        logits.mul_(softcap)
    if temperature != 1.0:
        logits.div_(temperature)
    return logits, slope


def logits_gradient(logits: torch.Tensor, slope: torch.Tensor | None, lse: torch.Tensor, targets: torch.Tensor,
                    g: torch.Tensor, temperature: float, logit_scale: float, start: int = 0) -> torch.Tensor:
    """d(Σ_n g_n logp_n) / d(projection) (c, V), in place of `logits` (c, V) from `scored_block`, whose rows'
    log-sum-exp over the whole vocabulary is lse (c,): `softmax_gradient` of exp(logits − lse)."""
    return softmax_gradient(logits.sub_(lse[:, None]).exp_(), slope, targets, g, temperature, logit_scale, start)


def softmax_gradient(probs: torch.Tensor, slope: torch.Tensor | None, targets: torch.Tensor, g: torch.Tensor,
                     temperature: float, logit_scale: float, start: int = 0) -> torch.Tensor:
    """d(Σ_n g_n logp_n) / d(projection) (c, V), in place of the softmax `probs` (c, V): g (c,) the gradient on each
    row's log-prob. d logp / d logits = onehot(target) − softmax; then through the temperature, the soft-cap's slope
    and the logit scale. The columns are vocabulary ids start … start + V − 1 (one rank's rows under tensor
    parallelism): a target outside them adds no one-hot."""
    g = g[:, None].to(probs.dtype)
    d_logits = probs.mul_(-g)
    width = d_logits.shape[1]
    if width:
        local = targets - start
        owned = (local >= 0) & (local < width)
        d_logits.scatter_add_(1, local.clamp(0, width - 1)[:, None], torch.where(owned[:, None], g, 0.0))
    if temperature != 1.0:
        d_logits.div_(temperature)  # d(logits / T) / d(logits)
    if slope is not None:
        d_logits.mul_(slope)  # d(capped) / d(scaled projection)
    if logit_scale != 1.0:
        d_logits.mul_(logit_scale)  # d(projection * s) / d(projection)
    return d_logits


def accumulate_block(d_logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, s: int,
                     d_hidden: torch.Tensor | None, d_weight: torch.Tensor | None, d_bias: torch.Tensor | None,
                     first: bool = False) -> None:
    """Add a block's share of the gradients from d_logits (c, V), in the weight's dtype (the two products run in the
    model's dtype): rows s … s + c − 1 of d_hidden (N, d), and d_weight (V, d), d_bias (V,) where they are wanted.
    first: the block writes d_weight and d_bias instead of adding, so they need no (V, d) zero fill."""
    if d_hidden is not None:
        d_hidden[s : s + h.shape[0]] = d_logits @ weight
    if d_weight is not None:  # beta = 0: what d_weight held is ignored, NaN included
        d_weight.addmm_(d_logits.t(), h, beta=0.0 if first else 1.0)
    if d_bias is not None:  # d(projection) / d(bias): one per row
        (d_bias.copy_ if first else d_bias.add_)(d_logits.sum(0))


def chunked_backward(ctx: Any, grad_out: torch.Tensor,
                     start: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(d_hidden, d_weight, d_bias) of a chunked log-prob whose forward saved (hidden, weight, bias or an empty
    tensor, targets, lse) and set `ctx`'s token_chunk, temperature, logit_scale, softcap and has_bias: each block's
    logits recomputed (`scored_block`), their gradient from the forward's lse (`logits_gradient`; `start`: the first
    vocabulary id of this rank's rows) accumulated into the inputs that need one (None for the others)."""
    hidden, weight, bias, targets, lse = ctx.saved_tensors
    bias = bias if ctx.has_bias else None
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    d_hidden = torch.empty_like(hidden) if need_h else None
    d_weight = torch.zeros_like(weight) if need_w else None
    d_bias = torch.zeros_like(bias) if need_b and bias is not None else None
    c = ctx.token_chunk
    for s in range(0, hidden.shape[0], c):
        h = hidden[s : s + c]
        logits, slope = scored_block(h, weight, bias, ctx.logit_scale, ctx.temperature, ctx.softcap)
        d_logits = logits_gradient(logits, slope, lse[s : s + c], targets[s : s + c], grad_out[s : s + c],
                                   ctx.temperature, ctx.logit_scale, start)  # (c, V)
        accumulate_block(d_logits.to(weight.dtype), h, weight, s, d_hidden, d_weight, d_bias)
    return d_hidden, d_weight, d_bias
