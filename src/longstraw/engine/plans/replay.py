"""Response replay from a captured prompt state: forward + backward of k responses at a time.

Each response o_i is replayed as the segment `[x[-1]] + o_i[:-1]` at positions P-1 … P+R_i-2 with
targets o_i: the last prompt token is part of the replayed segment, so the first response token's
log-prob depends on live activations and carries gradient (docs/design.md §2).

With loss masks (an agent's observation tokens, False), the output projection runs on the loss tokens only
(`logprobs.selected_logprobs`): a masked token adds nothing to the loss, so its log-prob is not computed, and the
per-response log-probs returned hold NaN there.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from longstraw.engine.hf.segment import run_segment
from longstraw.engine.logprobs import chunked_logprobs, selected_logprobs
from longstraw.engine.pad import pad
from longstraw.engine.router import RouterAux, responses_weights
from longstraw.engine.state.prompt import PromptState
from longstraw.models.architecture import hf, logit_scale, logit_softcap

# A micro-batch's share of the group loss from its log-probs and mask (k, T) and which responses it holds (both
# plans, replay and standard, call it; `api.backward_group` builds it).
LossFn = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


def filled(logprobs: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """The per-response log-probs once `finish_batch` has filled every slot in."""
    out = [lp for lp in logprobs if lp is not None]
    if len(out) != len(logprobs):
        raise RuntimeError("a response's log-probs were not computed")
    return out


def finish_batch(
    logp: torch.Tensor, mask: torch.Tensor, idx: list[int], loss_fn: LossFn | None,
    responses: list[torch.Tensor], logprobs: list[torch.Tensor | None],
) -> float:
    """Backward this batch's share of the group loss (unless only scoring), keep each response's detached
    log-probs (k, T) -> logprobs[i] (R_i,), and return the share's value."""
    value = 0.0
    if loss_fn is not None:
        loss = loss_fn(logp, mask, idx)
        value = float(loss.detach())
        # Checked before the backward: a non-finite value would turn every gradient it reaches into NaN.
        if not torch.isfinite(logp.detach()[mask]).all():
            raise FloatingPointError(
                f"responses {idx}: the model's log-probs are not finite (its forward overflowed in "
                f"{str(logp.dtype).removeprefix('torch.')}); this micro-batch's backward was not run. Use float32 or "
                "bfloat16, or check the weights"
            )
        if not math.isfinite(value):
            raise FloatingPointError(
                f"responses {idx}: their share of the loss is {value} (the ratio exp(logp - old) or the KL term "
                f"exp(ref - logp) overflowed {str(logp.dtype).removeprefix('torch.')}); this micro-batch's backward "
                "was not run. Check old_logprobs/ref_logprobs (the policy's own log-probs, not logits) and the "
                "advantages, or use a wider dtype"
            )
        loss.backward()
    for row, i in enumerate(idx):
        logprobs[i] = logp[row, : responses[i].numel()].detach()
    return value


def _with_router(loss_fn: LossFn, router: RouterAux, mask: torch.Tensor) -> LossFn:
    """`loss_fn` plus the router term of the forward about to run on segments whose real tokens `mask` (k, T) marks
    (the prompt's last token first, weighing `router.first_token_weight`)."""
    weights = responses_weights(mask, router.first_token_weight)
    router.tap.clear()

    def fn(logp: torch.Tensor, mask: torch.Tensor, idx: list[int]) -> torch.Tensor:
        return loss_fn(logp, mask, idx) + router.term(weights)

    return fn


def replay_responses(
    model: torch.nn.Module,
    prompt: torch.Tensor,
    state: PromptState,
    responses: list[torch.Tensor],
    loss_fn: LossFn | None,
    micro_batch: int,
    token_chunk: int,
    temperature: float = 1.0,
    loss_masks: list[torch.Tensor] | None = None,
    router: RouterAux | None = None,
) -> tuple[float, list[torch.Tensor]]:
    """Forward+backward every response from a fork of `state` (which holds prompt[:-1]).

    Gradients accumulate into the parameters and, when the state's tensors require grad (exact plan),
    into their `.grad`. With loss_fn=None it only scores (run it under no_grad: reference/old log-probs).
    temperature: log-probs of logits / temperature.
    loss_masks: one (R_i,) bool per response, True on the tokens the loss scores; with a loss_fn, the other tokens'
    log-probs are skipped (0 in the loss's input, where its mask zeroes them; NaN in the returned log-probs).
    router (needs a loss_fn): the router load-balancing term; each segment then runs all of o_i (its last token is
    routed in the full sequence too), and this forward's share of the term joins the backward.
    Returns (summed loss, per-response detached logp (R_i,)).
    """
    p = prompt.numel()
    head = hf(model).get_output_embeddings()
    weight, bias = head.weight, getattr(head, "bias", None)  # (V, d), (V,) or None
    scale = logit_scale(model)  # the factor the model's own forward applies to the projection (Cohere, Granite)
    softcap = logit_softcap(model)  # and its final-logit soft-cap after that factor (Gemma-2)
    total = 0.0
    logprobs: list[torch.Tensor | None] = [None] * len(responses)
    for first in range(0, len(responses), micro_batch):
        idx = list(range(first, min(first + micro_batch, len(responses))))
        routed = router is not None and loss_fn is not None
        segments = [torch.cat([prompt[-1:], responses[i] if routed else responses[i][:-1]]) for i in idx]
        inputs, routed_mask = pad(segments)  # (k, R_max), or (k, R_max + 1) with the router term
        targets, mask = pad([responses[i] for i in idx])  # (k, R_max)
        batch_fn = loss_fn if router is None or loss_fn is None else _with_router(loss_fn, router, routed_mask)
        if inputs.shape[1] == 1:
            # One-token segments: pad to two. transformers' SSM layers take an in-place single-token path
            # that autograd cannot differentiate; causality keeps the padding out of the real position.
            inputs, mask = torch.nn.functional.pad(inputs, (0, 1)), torch.nn.functional.pad(mask, (0, 1))
            targets = torch.nn.functional.pad(targets, (0, 1))
        hidden = run_segment(model, inputs, p - 1, state.fork())  # (k, R_max, d)
        assert hidden is not None  # None only with kv_only
        hidden = hidden[:, : targets.shape[1]]  # with the router term: without the last token's position
        if loss_masks is None or loss_fn is None:
            logp = chunked_logprobs(hidden, weight, targets, token_chunk, temperature, scale,
                                    softcap=softcap, bias=bias)  # (k, R_max)
        else:
            keep = torch.zeros_like(mask)  # (k, R_max): loss tokens
            for row, i in enumerate(idx):
                keep[row, : responses[i].numel()] = loss_masks[i].to(keep.device)
            logp = selected_logprobs(hidden, weight, targets, keep, token_chunk, temperature, scale,
                                     softcap=softcap, bias=bias)  # (k, R_max)
        total += finish_batch(logp, mask, idx, batch_fn, responses, logprobs)
        if loss_masks is not None and loss_fn is not None:
            for i in idx:  # not computed: NaN, so that no one reads the placeholder as a log-prob
                lp = logprobs[i]
                assert lp is not None
                logprobs[i] = lp.masked_fill(~loss_masks[i].to(lp.device), float("nan"))
    return total, filled(logprobs)
