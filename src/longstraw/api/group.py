"""`backward_group`: one GRPO group's gradient, accumulated into the model's parameters.

A group is a one-level prefix tree (prompt the root, each response a leaf: `Trajectory(prompt + o_i, loss_start=P)`)
run by the one engine, the tree walk (`api/tree.run_tree`, `engine/tree/`). One call, top to bottom:
  1. the options (`options.BackwardOptions`, validated on construction), then everything that depends on the model,
     the group and a reused prompt state (`_check`), including value ranges that would overflow the loss's dtype
     (fp32 for a bf16/fp16 model): nothing is computed or touched before the inputs are known good;
  2. skip the group when its loss gradient is identically zero (every advantage 0, beta = 0, no router term);
  3. the group's tree (`tree.build.group_tree`) and the walk of the plan: standard / standard_batched — full
     prompt+response forwards through the unmodified model; detach — the prompt's state captured once (no grad),
     each response replayed from a fork of it; exact — the same with the state as grad-requiring leaves, then the
     reverse chunked prompt backward (each piece's log-probs and loss are checked finite before its backward);
  4. on a refused piece, drop the gradients this call created (`_restoring_gradients`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from longstraw.api.checks import check_model_options, check_tokens, options_with
from longstraw.api.tree import TreeResult, run_tree
from longstraw.engine.group import Group
from longstraw.engine.options import BackwardOptions
from longstraw.engine.precision import accumulation_dtype, dtype_name
from longstraw.engine.state.checks import check_materialised, check_prompt_state
from longstraw.engine.state.prompt import PromptState
from longstraw.engine.tp_check import check_tensor_parallel_model
from longstraw.engine.tree.build import group_tree
from longstraw.models.architecture import eval_mode_when_equal, hf


class GroupResult(TreeResult):
    """A group's `TreeResult`. loss: the group loss (float); logprobs: detached (R_i,) per response, NaN at the tokens
    a loss mask marks False (their log-probs are not computed); stats: sizes and phase times.

    skipped: why no gradient pass ran ("zero_advantage": every advantage 0 and beta 0, so the loss and its gradient are
    exactly 0), or None. A skipped group has loss 0.0, no logprobs ([]) and zero phase times. With router_aux_coef > 0,
    `stats["router_aux_loss"]` is transformers' aux loss over the group's G sequences; `loss` leaves the term out."""


def _check_model_and_group(model: torch.nn.Module, group: Group, beta: float) -> None:
    total = group.prompt.numel() + max(group.lengths)
    check_tokens(model, total, group.max_token_id(),
                 f"prompt ({group.prompt.numel()}) + longest response ({max(group.lengths)}) = {total} tokens exceeds "
                 "the model's max_position_embeddings ({max_pos}): shorten the prompt or use a longer-context model")
    if beta and group.ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs in the Group (the reference model's log-probs)")


def _check_ranges(group: Group, dtype: torch.dtype) -> None:
    """Refuse finite inputs overflowing the loss's dtype (the accumulation dtype, precision.py) where the bound is sure.

    Advantages: |A| < sqrt(largest value), room for the backward's products (a GRPO advantage is a few units).
    old_logprobs: the ratio exp(logp - old) is at most exp(-old) (logp <= 0), so -old + log|A| must stay below
    log(largest value): in float32 that refuses log-probs below about -88, a probability under 1e-38 no sampler draws.
    (A float16 model's loss runs in float32 too: its tighter bound, e^11, which sampled tokens break, never applies.)"""
    finfo = torch.finfo(dtype)
    largest = float(group.advantages.abs().max())
    if not largest < math.sqrt(finfo.max):
        i = int(group.advantages.abs().argmax())
        raise ValueError(f"advantages[{i}] = {float(group.advantages[i]):.3g} is too large for the loss's dtype "
                         f"{dtype_name(dtype)}: |advantage| must be < {math.sqrt(finfo.max):.3g} (the square root of "
                         "its largest value, leaving room for the gradient's products); rescale the rewards or "
                         "normalise the advantages")
    for name in ("old_logprobs", "ref_logprobs"):
        for i, lp in enumerate(getattr(group, name) or []):
            values = _loss_tokens(group, i, lp)
            if not torch.isfinite(values.to(dtype)).all():
                raise ValueError(f"{name}[{i}] reaches {float(values.min()):.4g}, which is -inf in the loss's dtype "
                                 f"{dtype_name(dtype)}, at a token in the loss: pass the policy's log-probs, not a "
                                 "fill value")
    if group.old_logprobs is None:
        return
    log_max = math.log(finfo.max)
    for i, lp in enumerate(group.old_logprobs):
        lowest = float(_loss_tokens(group, i, lp).min())
        worst = -lowest + math.log(max(abs(float(group.advantages[i])), 1.0))
        if worst >= log_max:
            raise ValueError(f"old_logprobs[{i}] reaches {lowest:.4g} at a token in the loss: the ratio "
                             f"exp(logp - old) can then reach exp({-lowest:.4g}), which (times advantage "
                             f"{float(group.advantages[i]):.3g}) overflows {dtype_name(dtype)} (largest "
                             f"{finfo.max:.3g}). A sampled token is never that unlikely: pass the sampling policy's "
                             "log-probs (not logits or a fill value), or use float64")


def _loss_tokens(group: Group, i: int, values: torch.Tensor) -> torch.Tensor:
    """Response i's `values` at its loss tokens (all of them without loss masks): a masked token's old/ref
    log-prob never reaches the loss (`_loss_fn` replaces it), so an unlikely forced observation token, or the NaN
    that `GroupResult.logprobs` holds there, is no reason to refuse the group."""
    return values if group.loss_masks is None else values[group.loss_masks[i].to(values.device)]


def backward_group(model: torch.nn.Module, group: Group, options: BackwardOptions | None = None, *,
                   prompt_state: PromptState | None = None, **settings: Any) -> GroupResult:
    """Accumulate d(group loss)/d(params) into `.grad`, as `loss.backward()` would (never zeroes or steps).

    options: a `BackwardOptions` (plan, loss and its parameters, chunk size, micro-batch, checkpointing, offload,
    kept graphs, temperature, train mode, context shards); `settings`: any of its fields as keywords, applied
    on top of `options` (or of the defaults: plan "exact", loss "grpo"). Each is documented on `BackwardOptions`.
    prompt_state: a state already captured for this prompt (e.g. by the sampler, `sample_group(...).state`) to
    reuse instead of capturing again (detach/exact; prompt[:-1], with keep_boundaries=True for exact)."""
    options = options_with(options, settings, "backward_group")
    training = options.allow_train_mode and any(m.training for m in model.modules())
    with eval_mode_when_equal(model) if training else nullcontext():
        _check(model, group, options, prompt_state)
        return _backward(model, group, options, prompt_state)


def _check(model: torch.nn.Module, group: Group, options: BackwardOptions, prompt_state: PromptState | None) -> None:
    """What the options alone cannot say: this model, this group and this reused state."""
    if not isinstance(group, Group):
        raise TypeError(f"group must be a longstraw.Group, got {type(group).__name__}")
    check_model_options(model, options)
    check_materialised(model, "backward_group")
    check_tensor_parallel_model(model)
    _check_model_and_group(model, group, options.loss.beta)
    if options.context_shards is not None:
        options.context_shards.check_supported(model)
    if prompt_state is not None:
        _check_prompt_state(model, prompt_state, group, options)


def _check_prompt_state(model: torch.nn.Module, state: PromptState, group: Group, options: BackwardOptions) -> None:
    check_prompt_state(model, state, group.prompt)
    if options.keep_prompt_graph:
        raise ValueError("keep_prompt_graph keeps the graph of a capture backward_group runs itself, and a "
                         "prompt_state was passed (captured without one; its capture is already paid for): pass one or "
                         "the other")
    if options.plan.needs_chunk_boundaries and not state.keep_boundaries:
        raise ValueError("the exact plan needs a prompt_state captured with keep_boundaries=True (the recurrent "
                         "state at every chunk boundary); pass one, or none")


def _backward(model: torch.nn.Module, group: Group, options: BackwardOptions,
              prompt_state: PromptState | None) -> GroupResult:
    # The loss runs in the accumulation dtype (fp32 for a bf16/fp16 model, precision.py), as do its inputs.
    _check_ranges(group, accumulation_dtype(hf(model).get_input_embeddings().weight.dtype))
    stats: dict[str, float | int | str] = {"plan": options.plan.name, "prompt_tokens": group.prompt.numel(),
                                           "group_size": group.size, "checkpoint": options.checkpoint,
                                           "offload_state": options.offload_state,
                                           "keep_prompt_graph": options.keep_prompt_graph}
    root_state = None
    if prompt_state is not None and options.plan.captures_state:
        device = hf(model).get_input_embeddings().weight.device
        root_state = prompt_state.offload(device) if options.offload_state else prompt_state
        root_state = root_state.as_leaves() if options.plan.exact_gradient else root_state
    with _restoring_gradients(model):
        result = run_tree(model, group_tree(group), options, root_state=root_state, names="responses")
    stats.update(prompt_state_bytes=result.stats.get("peak_path_state_bytes", 0),
                 capture_s=result.stats.get("capture_s", 0.0), replay_s=result.stats.get("replay_s", 0.0),
                 prompt_backward_s=result.stats.get("backward_s", 0.0))
    stats.update({key: result.stats[key] for key in ("router_aux_loss", "router_count_s") if key in result.stats})
    return GroupResult(loss=result.loss, logprobs=result.logprobs, stats=stats, skipped=result.skipped)


@contextmanager
def _restoring_gradients(model: torch.nn.Module) -> Iterator[None]:
    """On a piece of the loss refused before its backward (FloatingPointError), drop the gradients that did not exist
    before the call; existing ones cannot be restored without a copy, so the error says what they hold."""
    params = list(model.parameters())
    had_grad = [p.grad is not None for p in params]
    try:
        yield
    except FloatingPointError as err:
        for p, had in zip(params, had_grad):
            if not had:
                p.grad = None
        done = getattr(err, "backwards", 0)
        if done > 0 and any(had_grad):
            raise FloatingPointError(f"{err}. The gradients that existed before this call hold the (finite) "
                                     f"contributions of this group's first {done} micro-batch(es): zero them before "
                                     "retrying") from None
        raise FloatingPointError(f"{err}. The gradients are as they were before this call") from None
