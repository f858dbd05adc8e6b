"""`backward_group`: one GRPO group's gradient, accumulated into the model's parameters.

Read top to bottom, one call is:
  1. the options (`options.BackwardOptions`, validated on construction), then everything that depends on the model,
     the group and a reused prompt state (`_check`), including value ranges that would overflow the loss's dtype
     (fp32 for a bf16/fp16 model): nothing is computed or touched before the inputs are known good;
  2. skip the group when its loss gradient is identically zero (every advantage 0 and beta = 0);
  3. fix the group constants the loss needs (G, Σ|o_i|, L_max) so replays in any grouping add up (`_loss_fn`);
  4. run the plan (`plans/`; each micro-batch's log-probs and loss are checked finite before its backward):
     standard / standard_batched — full prompt+response forwards through the unmodified model;
     detach — capture prompt[:-1] once (no grad), replay each response from a fork of the state;
     exact  — the same with the state as grad-requiring leaves, then the reverse chunked prompt backward;
  5. on a refused micro-batch, drop the gradients this call created (`_restoring_gradients`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from longstraw.admission.admission import check_architecture, is_recurrent
from longstraw.engine.activation_checkpointing import checkpointed_layers
from longstraw.engine.group import Group
from longstraw.engine.hf.composite import text_config
from longstraw.engine.loss.terms import GroupTotals, response_loss
from longstraw.engine.options import BackwardOptions
from longstraw.engine.plans.detach import detach
from longstraw.engine.plans.exact import exact
from longstraw.engine.plans.replay import LossFn
from longstraw.engine.plans.routes import count_routes
from longstraw.engine.plans.standard import standard
from longstraw.engine.precision import accumulation_dtype
from longstraw.engine.router import RouterAux, RouterCounts, aux_value
from longstraw.engine.state.checks import check_materialised, check_prompt_state
from longstraw.engine.state.prompt import PromptState
from longstraw.engine.tp_check import check_tensor_parallel_model
from longstraw.models.architecture import eval_mode_when_equal, hf


@dataclass
class GroupResult:
    """loss: the group loss (float); logprobs: detached (R_i,) per response (NaN at the tokens a loss mask marks
    False under the replay plans, exact and detach, which skip their output projection); stats: sizes and phase
    times.

    skipped: why no gradient pass ran ("zero_advantage": every advantage 0 and beta 0, so the loss and its
    gradient are exactly 0), or None. A skipped group has loss 0.0, no logprobs ([]) and zero phase times.

    router_probs: with router_aux_coef > 0, the group's Σ weight · softmax(router logits) over its tokens and MoE
    layers (E,) float32 (`router.aux_value` of a batch's counts and the sum over its groups is transformers' aux
    loss); `stats["router_aux_loss"]` is that value when the batch is the group itself. `loss` leaves the term out."""

    loss: float
    logprobs: list[torch.Tensor]
    stats: dict[str, float | int | str] = field(default_factory=dict)
    skipped: str | None = None
    router_probs: torch.Tensor | None = None


@dataclass(frozen=True)
class RouterBatch:
    """The batch the router load-balancing loss is taken over when it holds more than this group (a trainer's
    micro-batch of several groups): counts, the batch's `router_counts` summed over its groups; prompt_copies: how
    many of its sequences hold this group's prompt (None: the group's size G)."""

    counts: RouterCounts
    prompt_copies: int | None = None


def _check_model_and_group(model: torch.nn.Module, group: Group, beta: float) -> None:
    total = group.prompt.numel() + max(group.lengths)
    check_architecture(model, total)
    vocab = hf(model).get_input_embeddings().num_embeddings
    if group.max_token_id() >= vocab:
        raise ValueError(f"token id {group.max_token_id()} is out of the model's vocabulary (size {vocab})")
    max_pos = getattr(text_config(model), "max_position_embeddings", None)  # a composite's text tower's
    if max_pos is not None and total > max_pos:
        raise ValueError(
            f"prompt ({group.prompt.numel()}) + longest response ({max(group.lengths)}) = {total} tokens exceeds "
            f"the model's max_position_embeddings ({max_pos}): shorten the prompt or use a longer-context model"
        )
    if beta and group.ref_logprobs is None:
        raise ValueError("beta > 0 needs ref_logprobs in the Group (the reference model's log-probs)")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_ranges(group: Group, dtype: torch.dtype) -> None:
    """Refuse finite inputs that overflow the loss's dtype (the model's accumulation dtype: fp32 for a bf16/fp16
    model, precision.py) where the bound is sure.

    Advantages: |A| < sqrt(largest value), leaving room for the products of the backward (a GRPO advantage is
    a few units). old_logprobs: the ratio exp(logp - old) is at most exp(-old) (logp <= 0), so -old + log|A|
    must stay below log(largest value): in float32 that refuses log-probs below about -88, a probability under
    1e-38 that no sampler draws. (A float16 model's loss runs in float32 too, so its tighter bound, e^11, which
    ordinary sampled tokens would break, never applies.)"""
    finfo = torch.finfo(dtype)
    largest = float(group.advantages.abs().max())
    if not largest < math.sqrt(finfo.max):
        i = int(group.advantages.abs().argmax())
        raise ValueError(
            f"advantages[{i}] = {float(group.advantages[i]):.3g} is too large for the loss's dtype "
            f"{_dtype_name(dtype)}: |advantage| must be < {math.sqrt(finfo.max):.3g} (the square root of its largest "
            "value, leaving room for the gradient's products); rescale the rewards or normalise the advantages"
        )
    for name in ("old_logprobs", "ref_logprobs"):
        for i, lp in enumerate(getattr(group, name) or []):
            values = _loss_tokens(group, i, lp)
            if not torch.isfinite(values.to(dtype)).all():
                raise ValueError(f"{name}[{i}] reaches {float(values.min()):.4g}, which is -inf in the loss's dtype "
                                 f"{_dtype_name(dtype)}, at a token in the loss: pass the policy's log-probs, not a "
                                 "fill value")
    if group.old_logprobs is None:
        return
    log_max = math.log(finfo.max)
    for i, lp in enumerate(group.old_logprobs):
        lowest = float(_loss_tokens(group, i, lp).min())
        worst = -lowest + math.log(max(abs(float(group.advantages[i])), 1.0))
        if worst >= log_max:
            raise ValueError(
                f"old_logprobs[{i}] reaches {lowest:.4g} at a token in the loss: the ratio exp(logp - old) can then "
                f"reach exp({-lowest:.4g}), which (times advantage {float(group.advantages[i]):.3g}) overflows "
                f"{_dtype_name(dtype)} (largest {finfo.max:.3g}). A sampled token is never that unlikely: pass the "
                "sampling policy's log-probs (not logits or a fill value), or use float64"
            )


def _loss_tokens(group: Group, i: int, values: torch.Tensor) -> torch.Tensor:
    """Response i's `values` at its loss tokens (all of them without loss masks): a masked token's old/ref
    log-prob never reaches the loss (`_loss_fn` replaces it), so an unlikely forced observation token, or the NaN
    that `GroupResult.logprobs` holds there, is no reason to refuse the group."""
    if group.loss_masks is None:
        return values
    return values[group.loss_masks[i].to(values.device)]


def backward_group(
    model: torch.nn.Module,
    group: Group,
    options: BackwardOptions | None = None,
    *,
    prompt_state: PromptState | None = None,
    router_batch: RouterBatch | None = None,
    **settings: Any,
) -> GroupResult:
    """Accumulate d(group loss)/d(params) into `.grad`, as `loss.backward()` would (never zeroes or steps).

    options: a `BackwardOptions` (plan, loss and its parameters, chunk size, micro-batch, checkpointing, offload,
    kept graphs, temperature, train mode, context shards); `settings`: any of its fields as keywords, applied
    on top of `options` (or of the defaults: plan "exact", loss "grpo"). Each is documented on `BackwardOptions`.
    prompt_state: a state already captured for this prompt (e.g. by the sampler, `sample_group(...).state`) to
    reuse instead of capturing again (detach/exact; prompt[:-1], with keep_boundaries=True for exact).
    router_batch (router_aux_coef > 0): the batch the load-balancing loss is taken over, when larger than the group.
    """
    options = _options(options, settings)
    training = options.allow_train_mode and any(m.training for m in model.modules())
    with eval_mode_when_equal(model) if training else nullcontext():
        _check(model, group, options, prompt_state)
        _check_router_batch(group, options, router_batch)
        return _backward(model, group, options, prompt_state, router_batch)


def router_counts(model: torch.nn.Module, group: Group, options: BackwardOptions | None = None, *,
                  prompt_copies: int | None = None, **settings: Any) -> RouterCounts:
    """The group's top-k router counts (`engine/router.py`), each prompt token counted `prompt_copies` times (None:
    G), through the passes `options`' plan runs, without grad: add those of a batch's groups for `RouterBatch`."""
    options = _options(options, settings)
    training = options.allow_train_mode and any(m.training for m in model.modules())
    with eval_mode_when_equal(model) if training else nullcontext():
        _check(model, group, options, None)
        prompt, responses = _on_device(model, group)
        counts, _ = count_routes(model, prompt, responses, options, None, prompt_copies or group.size)
    return counts


def _check_router_batch(group: Group, options: BackwardOptions, router_batch: RouterBatch | None) -> None:
    if router_batch is None:
        return
    if not isinstance(router_batch, RouterBatch):
        raise TypeError(f"router_batch must be a longstraw RouterBatch, got {type(router_batch).__name__}")
    if not options.router_aux_coef:
        raise ValueError("router_batch is the batch of the router load-balancing loss, which is off: set "
                         "router_aux_coef > 0 or pass no router_batch")
    copies = router_batch.prompt_copies
    if copies is not None and (isinstance(copies, bool) or not isinstance(copies, int) or copies < group.size):
        raise ValueError(f"router_batch.prompt_copies must be an integer >= the group's size ({group.size}): the "
                         f"sequences of the batch that hold the prompt, got {copies!r}")


def _on_device(model: torch.nn.Module, group: Group) -> tuple[torch.Tensor, list[torch.Tensor]]:
    device = hf(model).get_input_embeddings().weight.device
    prompt = group.prompt.to(device=device, dtype=torch.long)
    return prompt, [r.to(device=device, dtype=torch.long) for r in group.responses]


def _options(options: BackwardOptions | None, settings: dict[str, Any]) -> BackwardOptions:
    """`options` with `settings` applied; an unknown keyword names the valid ones."""
    if options is not None and not isinstance(options, BackwardOptions):
        raise TypeError(f"options must be a longstraw.BackwardOptions, got {type(options).__name__}")
    unknown = sorted(set(settings) - set(BackwardOptions.names()))
    if unknown:
        raise TypeError(f"backward_group got an unexpected keyword argument {unknown[0]!r}; valid options: "
                        f"{', '.join(BackwardOptions.names())}, prompt_state")
    if options is None:
        return BackwardOptions(**settings)
    return replace(options, **settings) if settings else options


def check_model_options(model: torch.nn.Module, options: BackwardOptions) -> None:
    """The refusals that need the model and the options but no group, so a trainer can make them when it is built:
    nothing to train, and the exact plan's one-token chunks on a recurrent model."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("no parameter of the model requires grad, so there is nothing to train: unfreeze the "
                         "parameters to train (param.requires_grad_(True)) or add an adapter")
    model_type = hf(model).config.model_type
    if options.plan == "exact" and options.chunk_size == 1 and is_recurrent(model):
        raise ValueError(
            f"chunk_size=1 with the exact plan on {model_type}: its recurrent layers update their "
            "state in place for one-token chunks, which the prompt backward cannot differentiate; use chunk_size >= 2"
        )


def _check(model: torch.nn.Module, group: Group, options: BackwardOptions, prompt_state: PromptState | None) -> None:
    """What the options alone cannot say: this model, this group and this reused state."""
    if not isinstance(group, Group):
        raise TypeError(f"group must be a longstraw.Group, got {type(group).__name__}")
    check_model_options(model, options)
    check_materialised(model, "backward_group")
    check_tensor_parallel_model(model)
    _check_model_and_group(model, group, options.loss_config.beta)
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
    if options.plan == "exact" and not state.keep_boundaries:
        raise ValueError("the exact plan needs a prompt_state captured with keep_boundaries=True (the recurrent "
                         "state at every chunk boundary); pass one, or none")


def _backward(model: torch.nn.Module, group: Group, options: BackwardOptions,
              prompt_state: PromptState | None, router_batch: RouterBatch | None = None) -> GroupResult:
    device = hf(model).get_input_embeddings().weight.device
    # The loss runs in the accumulation dtype (fp32 for a bf16/fp16 model, precision.py), as do its inputs.
    dtype = accumulation_dtype(hf(model).get_input_embeddings().weight.dtype)
    _check_ranges(group, dtype)
    stats: dict[str, float | int | str] = {"plan": options.plan, "prompt_tokens": group.prompt.numel(),
                                           "group_size": group.size, "checkpoint": options.checkpoint,
                                           "offload_state": options.offload_state,
                                           "keep_prompt_graph": options.keep_prompt_graph}
    if options.loss_config.beta == 0 and not options.router_aux_coef and options.loss_config.kind != "nll" and \
            not bool((group.advantages != 0).any()):
        # Every GRPO-family policy term is A times a function of the ratio and log-probs (cispo and vespo weigh logp
        # by detached weights), plus the KL term only when beta > 0: with every A = 0 the gradient is exactly zero, so
        # the passes would add zeros. (nll ignores the advantages.)
        stats.update(prompt_state_bytes=prompt_state.nbytes() if prompt_state is not None else 0, capture_s=0.0,
                     replay_s=0.0, prompt_backward_s=0.0)
        return GroupResult(loss=0.0, logprobs=[], stats=stats, skipped="zero_advantage")
    prompt, responses = _on_device(model, group)
    loss_fn, backwards = _loss_fn(group, options, device, dtype)
    router = None
    if options.router_aux_coef:
        copies = group.size if router_batch is None or router_batch.prompt_copies is None else \
            router_batch.prompt_copies
        t0 = time.perf_counter()
        if router_batch is None:  # the group is the batch: count it (and keep the prompt state for the plan)
            counts, state = count_routes(model, prompt, responses, options, prompt_state, copies)
            prompt_state = state if options.plan in ("detach", "exact") else prompt_state
        else:  # counted by the caller (`router_counts` over the batch's groups)
            counts = router_batch.counts
        router = RouterAux(model, counts, options.router_aux_coef, copies, group.size)
        stats["router_count_s"] = time.perf_counter() - t0
    with _restoring_gradients(model, backwards), checkpointed_layers(model, enabled=options.checkpoint == "layers"):
        if router is None:
            total, logprobs = _run_plan(model, prompt, responses, loss_fn, options, prompt_state, stats,
                                        group.loss_masks)
        else:
            with router.tap.hooked():
                total, logprobs = _run_plan(model, prompt, responses, loss_fn, options, prompt_state, stats,
                                            group.loss_masks, router)
    if router is None:
        return GroupResult(loss=total, logprobs=logprobs, stats=stats)
    if router_batch is None:
        stats["router_aux_loss"] = aux_value(router.counts, router.prob_sums)
    return GroupResult(loss=total, logprobs=logprobs, stats=stats, router_probs=router.prob_sums)


def _loss_fn(group: Group, options: BackwardOptions, device: torch.device,
             dtype: torch.dtype) -> tuple[LossFn, list[int]]:
    """The loss of a micro-batch of this group, and a counter of the micro-batches whose loss was built (hence
    backpropagated unless the finite check refused it)."""
    totals = GroupTotals.of(group.loss_lengths, options.loss_config)  # normalisers count loss tokens only
    advantages = group.advantages.to(device=device, dtype=dtype)
    backwards = [0]

    def padded(values: list[torch.Tensor] | None, idx: list[int], logp: torch.Tensor,
               loss_mask: torch.Tensor | None) -> torch.Tensor | None:
        """values[i] for i in idx, right-padded with zeros to logp's shape (k, T); with loss masks, the policy's own
        (detached) log-probs off the loss tokens, so that whatever the caller holds there (an unlikely forced token's
        log-prob, the NaN of `GroupResult.logprobs`) gives a ratio of 1 and a KL of 0 before the mask zeroes it (NaN
        or an overflow times 0 would still be NaN)."""
        if values is None:
            return None
        out = torch.zeros(logp.shape, dtype=dtype, device=device)
        for row, i in enumerate(idx):
            out[row, : values[i].numel()] = values[i].to(device=device, dtype=dtype)
        if loss_mask is not None:
            out = torch.where(loss_mask, out, logp.detach().to(dtype))
        return out

    def loss_fn(logp: torch.Tensor, mask: torch.Tensor, idx: list[int]) -> torch.Tensor:
        """This micro-batch's share of the group loss; logp/mask (k, T), idx: which responses."""
        backwards[0] += 1
        in_loss = None
        if group.loss_masks is not None:  # masked tokens: in the forward, not in the loss
            loss_mask = torch.zeros(mask.shape, dtype=torch.bool, device=device)
            for row, i in enumerate(idx):
                loss_mask[row, : group.loss_masks[i].numel()] = group.loss_masks[i].to(device)
            mask = in_loss = mask & loss_mask
        return response_loss(
            logp, mask, advantages[idx], totals, options.loss_config,
            old_logp=padded(group.old_logprobs, idx, logp, in_loss),
            ref_logp=padded(group.ref_logprobs, idx, logp, in_loss),
        )

    return loss_fn, backwards


@contextmanager
def _restoring_gradients(model: torch.nn.Module, backwards: list[int]) -> Iterator[None]:
    """On a micro-batch refused before its backward (FloatingPointError), drop the gradients that did not exist
    before the call; existing ones cannot be restored without a copy, so the error says what they hold."""
    params = list(model.parameters())
    had_grad = [p.grad is not None for p in params]
    try:
        yield
    except FloatingPointError as err:
        for p, had in zip(params, had_grad):
            if not had:
                p.grad = None
        done = backwards[0] - 1
        if done > 0 and any(had_grad):
            raise FloatingPointError(f"{err}. The gradients that existed before this call hold the (finite) "
                                     f"contributions of this group's first {done} micro-batch(es): zero them before "
                                     "retrying") from None
        raise FloatingPointError(f"{err}. The gradients are as they were before this call") from None


def _run_plan(model: torch.nn.Module, prompt: torch.Tensor, responses: list[torch.Tensor], loss_fn: LossFn,
              options: BackwardOptions, prompt_state: PromptState | None,
              stats: dict[str, float | int | str],
              loss_masks: list[torch.Tensor] | None = None,
              router: RouterAux | None = None) -> tuple[float, list[torch.Tensor]]:
    """The plan itself; phase times and the state's size go into `stats`. The replay plans skip the output
    projection of tokens that `loss_masks` marks False (the standard plans, the ground truth, score every token)."""
    plan = options.plan
    if plan in ("standard", "standard_batched"):
        t0 = time.perf_counter()
        total, logprobs = standard(model, prompt, responses, loss_fn, batched=plan == "standard_batched",
                                   temperature=options.temperature, router=router)
        stats.update(prompt_state_bytes=0, capture_s=0.0, replay_s=time.perf_counter() - t0, prompt_backward_s=0.0)
        return total, logprobs
    elif plan == "detach":
        return detach(model, prompt, responses, loss_fn, options, prompt_state, stats, loss_masks, router)
    elif plan == "exact":
        return exact(model, prompt, responses, loss_fn, options, prompt_state, stats, loss_masks, router)
    else:
        raise ValueError(f"unknown plan {plan!r}")
