"""The standard plan, the ground truth: every response scored as a full `prompt + response` sequence
through the unmodified transformers model (its own attention, its own logits), as TRL/verl/OpenRLHF do.

`standard` runs one sequence at a time with gradient accumulation; `standard_batched` puts all G
sequences in one right-padded batch (a trainer with per-device batch G).
"""

from __future__ import annotations

import torch

from longstraw.engine.pad import pad
from longstraw.engine.plans.replay import LossFn, filled, finish_batch
from longstraw.engine.precision import accumulation_dtype
from longstraw.engine.router import RouterAux


def _score(model: torch.nn.Module, prompt: torch.Tensor, responses: list[torch.Tensor], temperature: float = 1.0):
    """Full forward of prompt + each response, right-padded. Returns logp (B, R_max) and mask (B, R_max), the
    log-probs of logits / temperature."""
    targets, mask = pad(responses)  # (B, R_max)
    r_max = targets.shape[1]
    inputs = torch.cat([prompt.expand(len(responses), -1), targets], dim=1)  # (B, P + R_max)
    attention_mask = torch.cat([torch.ones_like(prompt).expand(len(responses), -1), mask.long()], dim=1)
    # Position P-1+t predicts response token t: keep the last R_max+1 logits and drop the final one.
    logits = model(input_ids=inputs, attention_mask=attention_mask, logits_to_keep=r_max + 1, use_cache=False).logits
    logits = logits[:, :-1].to(accumulation_dtype(logits.dtype))  # (B, R_max, V); fp32 for bf16 (precision.py)
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp, mask


def _routed(loss_fn: LossFn, router: RouterAux, prompt: torch.Tensor, mask: torch.Tensor) -> LossFn:
    """`loss_fn` plus the router term of a forward over [prompt ; response] rows, `mask` (B, R_max) on the responses'
    real tokens; each row's prompt tokens weigh `router.first_token_weight` (prompt_copies / G)."""
    prompt_weights = torch.full((mask.shape[0], prompt.numel()), router.first_token_weight, dtype=torch.float64,
                                device=mask.device)
    weights = torch.cat([prompt_weights, mask.to(torch.float64)], dim=1)  # (B, P + R_max)

    def fn(logp: torch.Tensor, mask: torch.Tensor, idx: list[int]) -> torch.Tensor:
        return loss_fn(logp, mask, idx) + router.term(weights)

    return fn


def standard(model, prompt, responses, loss_fn: LossFn, batched: bool,
             temperature: float = 1.0, router: RouterAux | None = None) -> tuple[float, list[torch.Tensor]]:
    """Accumulate the group gradient into the parameters; return (loss, per-response detached logp). router: the
    router load-balancing term of every token of the full sequences, added to each backward."""
    batches = [list(range(len(responses)))] if batched else [[i] for i in range(len(responses))]
    total = 0.0
    logprobs: list[torch.Tensor | None] = [None] * len(responses)
    for idx in batches:
        if router is not None:
            router.tap.clear()
        logp, mask = _score(model, prompt, [responses[i] for i in idx], temperature)
        fn = loss_fn if router is None else _routed(loss_fn, router, prompt, mask)
        total += finish_batch(logp, mask, idx, fn, responses, logprobs)
    return total, filled(logprobs)
