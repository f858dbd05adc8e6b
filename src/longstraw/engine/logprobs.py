"""Per-token log-probabilities of target ids without materialising the `[N, vocab]` logits.

`chunked_logprobs` runs the output projection over blocks of `token_chunk` rows; forward keeps only the log-probs,
backward recomputes each block's logits and softmax. Peak extra memory is one block of logits (`token_chunk x vocab`;
two in backward with a soft-cap, whose slope 1 - tanh^2 is kept beside the softmax) instead of all of them (8k tokens x
150k vocab in fp32 would be 4.9 GB). `naive_logprobs` beside it is the plain reference the parity test compares with. An
output projection split by vocabulary over a tensor-parallel group (a DTensor, transformers' tp_plan) goes to
`tp_logprobs`, which reduces the log-sum-exp and the target's logit across the ranks instead of gathering logits.

`selected_logprobs` runs `chunked_logprobs` on the rows a boolean `keep` selects only (an agent's loss tokens: its
observation tokens need no log-prob) and scatters them back with a placeholder elsewhere; `masked_logprobs_reference`
beside it computes every row and overwrites the others, the plain statement it must equal.

`temperature` scores log_softmax(logits / temperature), as samplers that draw at a temperature (and TRL's trainer)
define the policy's log-probs. `logit_scale` is a factor the model's own forward applies to the projection before
anything else (Cohere's `logits = lm_head(h) * logit_scale`, Granite's `/ logits_scaling`:
`models.architecture.logit_scale` says which factor a model uses). `softcap` is the final-logit soft-capping of Gemma-2
(`final_logit_softcapping`, `models.architecture.logit_softcap`): softcap * tanh(logits / softcap). The logits scored
are then softcap * tanh((hidden @ weight.T) * logit_scale / softcap) / temperature, in that order, as transformers'
forward forms them and the samplers then divide by the temperature."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from longstraw.engine.logits import chunked_backward, scaled_logits
from longstraw.engine.precision import accumulated_product, accumulation_dtype, head_input

DEFAULT_TOKEN_CHUNK = 1024


def accumulated_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """h (c, d) @ weight (V, d)^T (+ bias (V,)) -> (c, V) in the accumulation dtype (`precision.py`): for bf16/fp16
    on CUDA straight from the GEMM's fp32 accumulator (torch.mm's out_dtype), elsewhere cast after the product.
    A weight split by vocabulary over a tensor-parallel group (DTensor): every rank gets the full (c, V), gathered
    (`tp_logprobs.gathered_logits`, the sampler's one position per sequence; no gradient)."""
    if isinstance(weight, DTensor):
        from longstraw.engine.tp_logprobs import gathered_logits

        return gathered_logits(h, weight, bias)
    return accumulated_product(head_input(h, weight), weight, bias)


def check_softcap(softcap: float | None) -> None:
    """A soft-cap must be a positive number (or None: none)."""
    if softcap is not None and not softcap > 0:
        raise ValueError(f"final_logit_softcapping must be > 0 or None, got {softcap}")


class _ChunkedLogprobs(torch.autograd.Function):
    """hidden (N, d), weight (V, d), bias (V,) or None, targets (N,) -> logp (N,) =
    log_softmax(cap((hidden @ weight.T + bias) * s) / T)[n, targets[n]] (s: logit_scale; cap(x) = softcap *
    tanh(x / softcap), the identity without a softcap), in the accumulation dtype (fp32 for a bf16/fp16 model; the
    logits, log-sum-exp and softmax too)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                token_chunk: int, temperature: float = 1.0, logit_scale: float = 1.0, softcap: float | None = None):
        out = torch.empty(hidden.shape[0], dtype=accumulation_dtype(hidden.dtype), device=hidden.device)
        lse = torch.empty_like(out)
        for s in range(0, hidden.shape[0], token_chunk):
            logits = scaled_logits(accumulated_logits(hidden[s : s + token_chunk], weight, bias), logit_scale,
                             temperature, softcap)  # (c, V)
            tgt = targets[s : s + token_chunk]
            lse[s : s + token_chunk] = torch.logsumexp(logits, dim=-1)
            out[s : s + token_chunk] = logits.gather(1, tgt[:, None]).squeeze(1) - lse[s : s + token_chunk]
        ctx.token_chunk = token_chunk
        ctx.temperature, ctx.logit_scale, ctx.softcap = temperature, logit_scale, softcap
        ctx.has_bias = bias is not None
        ctx.save_for_backward(hidden, weight, bias if bias is not None else weight.new_empty(0), targets, lse)
        return out  # lse: N numbers, so backward skips a softmax pass

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        return *chunked_backward(ctx, grad_out), None, None, None, None, None


def chunked_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, token_chunk: int = DEFAULT_TOKEN_CHUNK,
    temperature: float = 1.0, logit_scale: float = 1.0, softcap: float | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden (..., d), weight (V, d), targets (...) -> log-probs (...) of the logits (hidden @ weight.T + bias) *
    logit_scale, soft-capped to softcap * tanh(. / softcap) if softcap is set, at `temperature`. bias (V,): the output
    projection's (Phi-2, CodeGen, GPT-J), or None. Differentiable in hidden, weight and bias. A weight that is a DTensor
    split by vocabulary runs `tp_logprobs.vocab_parallel_logprobs` (every rank of its group calls it, same hidden)."""
    check_softcap(softcap)
    shape = targets.shape
    hidden = head_input(hidden, weight)
    if isinstance(weight, DTensor):  # split by vocabulary over a tensor-parallel group
        from longstraw.engine.tp_logprobs import vocab_parallel_logprobs

        flat = vocab_parallel_logprobs(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1),
                                       token_chunk, temperature, logit_scale, softcap, bias)
        return flat.view(shape)
    flat = _ChunkedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1),
                                  token_chunk, temperature, logit_scale, softcap)
    return flat.view(shape)


def naive_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   temperature: float = 1.0, logit_scale: float = 1.0, softcap: float | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: full logits (with the bias), soft-cap (as transformers' Gemma-2 forward: / cap, tanh, * cap),
    log_softmax, gather. Same shapes as `chunked_logprobs`; fp32 for bf16/fp16."""
    projection = hidden @ weight.t() if bias is None else hidden @ weight.t() + bias
    logits = (projection * logit_scale).to(accumulation_dtype(hidden.dtype))
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def selected_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor,
    token_chunk: int = DEFAULT_TOKEN_CHUNK, temperature: float = 1.0, logit_scale: float = 1.0, fill: float = 0.0,
    softcap: float | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden (..., d), weight (V, d), targets (...), keep (...) bool -> log-probs (...): `chunked_logprobs` where
    keep is True, `fill` elsewhere (no gradient there). The output projection runs on keep's True rows only, so it
    costs 2·d·V FLOPs per kept row in the forward instead of per row. Rows are independent, so the kept values
    and every gradient equal `chunked_logprobs`' up to the summation order of the weight's gradient."""
    shape = targets.shape
    rows = keep.reshape(-1).nonzero().squeeze(1)  # (n,)
    kept = chunked_logprobs(hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows), weight,
                            targets.reshape(-1).index_select(0, rows), token_chunk, temperature, logit_scale,
                            softcap, bias)  # (n,)
    out = torch.full((targets.numel(),), fill, dtype=kept.dtype, device=kept.device)
    return out.index_copy(0, rows, kept).view(shape)  # differentiable in `kept`


def masked_logprobs_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor,
    temperature: float = 1.0, logit_scale: float = 1.0, fill: float = 0.0, softcap: float | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference for `selected_logprobs`: every row's log-prob (`naive_logprobs`), then `fill` where not `keep`."""
    full = naive_logprobs(hidden, weight, targets, temperature, logit_scale, softcap, bias)
    return torch.where(keep, full, torch.full_like(full, fill))
