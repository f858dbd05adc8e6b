"""`backward_group`: one GRPO group's gradient, accumulated into the model's parameters.

Read top to bottom, a training step is:
  1. validate everything (nothing is computed or touched before the inputs are known good), including value
     ranges that would overflow the loss's dtype (fp32 for a bf16/fp16 model);
  2. skip the group when its loss gradient is identically zero (every advantage 0 and beta = 0);
  3. fix the group constants the loss needs (G, Σ|o_i|, L_max) so replays in any grouping add up;
  4. by plan (each micro-batch's log-probs and loss are checked finite before its backward):
     standard / standard_batched — full prompt+response forwards through the unmodified model;
     detach — capture prompt[:-1] once (no grad), replay each response from a fork of the state;
     exact  — the same with the state as grad-requiring leaves, then the reverse chunked prompt backward.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from longstraw.choices import MODES as MODES  # the older name of PLANS, kept for importers
from longstraw.choices import PLANS
from longstraw.engine.activation_checkpointing import check_checkpoint, checkpointed_layers
from longstraw.engine.group import Group
from longstraw.engine.logprobs import DEFAULT_TOKEN_CHUNK
from longstraw.engine.loss import GroupTotals, make_loss_config, response_loss
from longstraw.engine.plans.exact import prompt_backward
from longstraw.engine.plans.replay import replay_responses
from longstraw.engine.plans.standard import standard
from longstraw.engine.precision import accumulation_dtype
from longstraw.engine.state.capture import capture_prompt
from longstraw.engine.state.prompt import PromptState, prompt_fingerprint
from longstraw.models.architecture import RECURRENT_MODEL_TYPES, check_architecture, eval_mode_when_equal, hf


@dataclass
class GroupResult:
    """loss: the group loss (float); logprobs: detached (R_i,) per response; stats: sizes and phase times.

    skipped: why no gradient pass ran ("zero_advantage": every advantage 0 and beta 0, so the loss and its
    gradient are exactly 0), or None. A skipped group has loss 0.0, no logprobs ([]) and zero phase times."""

    loss: float
    logprobs: list[torch.Tensor]
    stats: dict[str, float | int | str] = field(default_factory=dict)
    skipped: str | None = None


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def _validate(model: torch.nn.Module, group: Group, plan: str, beta: float) -> None:
    if not isinstance(group, Group):
        raise TypeError(f"group must be a longstraw.Group, got {type(group).__name__}")
    if plan not in PLANS:
        raise ValueError(f"unknown plan {plan!r}: choose one of {', '.join(PLANS)}")
    total = group.prompt.numel() + max(group.lengths)
    check_architecture(model, total)
    vocab = hf(model).get_input_embeddings().num_embeddings
    if group.max_token_id() >= vocab:
        raise ValueError(f"token id {group.max_token_id()} is out of the model's vocabulary (size {vocab})")
    max_pos = getattr(model.config, "max_position_embeddings", None)
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
            if not torch.isfinite(lp.to(dtype)).all():
                raise ValueError(f"{name}[{i}] reaches {float(lp.min()):.4g}, which is -inf in the loss's dtype "
                                 f"{_dtype_name(dtype)}: pass the policy's log-probs, not a fill value")
    if group.old_logprobs is None:
        return
    log_max = math.log(finfo.max)
    for i, lp in enumerate(group.old_logprobs):
        worst = -float(lp.min()) + math.log(max(abs(float(group.advantages[i])), 1.0))
        if worst >= log_max:
            raise ValueError(
                f"old_logprobs[{i}] reaches {float(lp.min()):.4g}: the ratio exp(logp - old) can then reach "
                f"exp({-float(lp.min()):.4g}), which (times advantage {float(group.advantages[i]):.3g}) overflows "
                f"{_dtype_name(dtype)} (largest {finfo.max:.3g}). A sampled token is never that unlikely: pass the "
                "sampling policy's log-probs (not logits or a fill value), or use float64"
            )


def backward_group(
    model: torch.nn.Module,
    group: Group,
    plan: str | None = None,
    loss: str = "grpo",
    chunk_size: int = 2048,
    micro_batch: int = 1,
    token_chunk: int = DEFAULT_TOKEN_CHUNK,
    prompt_state: PromptState | None = None,
    context_parallel=None,
    checkpoint: str = "none",
    offload_state: bool = False,
    keep_prompt_graph: int = 0,
    temperature: float = 1.0,
    allow_train_mode: bool = False,
    mode: str | None = None,
    **loss_options: float | int | bool | None,
) -> GroupResult:
    """Accumulate d(group loss)/d(params) into `.grad`, as `loss.backward()` would (never zeroes or steps).

    plan: standard | standard_batched | detach | exact (default exact); `mode` is its older name, still accepted
    (give one of the two). chunk_size: prompt tokens per capture chunk (and per prompt-backward chunk of the exact
    plan). micro_batch: responses replayed at once (detach/exact).
    token_chunk: rows per block of the chunked log-prob. prompt_state: a state already captured for this
    prompt (e.g. by the sampler, `Rollout.state`) to reuse instead of capturing again (detach/exact).
    context_parallel: a context-parallel group (`state.sharding.ContextShards`, made by
    `distributed.context.ContextParallel`) (detach/exact): every rank of it calls
    this with the same group and keeps 1/C of the prompt's attention state; each ends with the full gradient.
    checkpoint: "none" or "layers" (per-layer activation checkpointing of every forward with grad: replay
    micro-batches, the exact plan's prompt-backward chunks, the standard plans' sequences; `activation_checkpointing.py`).
    offload_state: keep the prompt state (and the exact plan's state gradient) in host memory and copy one layer's
    part at a time to the device where it is read (detach/exact; saves device memory with checkpoint="layers").
    keep_prompt_graph: exact plan, when it captures the prompt itself (no prompt_state): the last N capture chunks
    run with grad and keep their graph until the prompt backward, which then skips their recompute (one prompt
    forward fewer per kept chunk, for their activations held through the replays; N >= the number of chunks keeps
    them all; 0, the default, recomputes every chunk: the lowest peak). `longstraw plan` forecasts its memory.
    temperature: score log-probs of logits / temperature (the sampling temperature; TRL scores at it), in every plan.
    allow_train_mode: accept a model in train() mode when its train and eval forwards compute the same numbers (no
    dropout with p > 0, no attention dropout: `models.active_dropout`); the call runs it in eval() and restores each
    module's mode after. False: any module in train() mode is refused.
    loss_options: epsilon, epsilon_low, epsilon_high, beta, max_tokens, token_normalizer, kl_ratio, loss_scale
    (see `longstraw.engine.loss`).
    """
    if plan is not None and mode is not None:
        raise TypeError(f"backward_group got plan={plan!r} and mode={mode!r}: mode is the older name of plan, give "
                        "only plan")
    plan = plan if plan is not None else mode if mode is not None else "exact"
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if not isinstance(allow_train_mode, bool):
        raise TypeError(f"allow_train_mode must be True or False, got {allow_train_mode!r}")
    in_train = allow_train_mode and any(m.training for m in model.modules())
    modes = eval_mode_when_equal(model) if in_train else nullcontext()
    with modes:
        return _backward_group(model, group, plan, loss, chunk_size, micro_batch, token_chunk, prompt_state,
                               context_parallel, checkpoint, offload_state, keep_prompt_graph, float(temperature),
                               loss_options)


def _backward_group(model, group, plan, loss, chunk_size, micro_batch, token_chunk, prompt_state, context_parallel,
                    checkpoint, offload_state, keep_prompt_graph, temperature, loss_options) -> GroupResult:
    try:
        cfg = make_loss_config(loss, **loss_options)
    except TypeError as err:
        raise TypeError(f"{err}; valid loss options: epsilon, epsilon_low, epsilon_high, beta, max_tokens, "
                        "token_normalizer, kl_ratio, loss_scale") from None
    chunk_size = _positive_int("chunk_size", chunk_size)
    micro_batch = _positive_int("micro_batch", micro_batch)
    token_chunk = _positive_int("token_chunk", token_chunk)
    checkpoint = check_checkpoint(checkpoint)
    if not isinstance(offload_state, bool):
        raise TypeError(f"offload_state must be True or False, got {offload_state!r}")
    _validate(model, group, plan, cfg.beta)
    if plan == "exact" and chunk_size == 1 and model.config.model_type in RECURRENT_MODEL_TYPES:
        raise ValueError(
            f"chunk_size=1 with the exact plan on {model.config.model_type}: its recurrent layers update their "
            "state in place for one-token chunks, which the prompt backward cannot differentiate; use chunk_size >= 2"
        )
    if prompt_state is not None and prompt_state.length != group.prompt.numel() - 1:
        raise ValueError(
            f"prompt_state holds {prompt_state.length} positions but this prompt needs {group.prompt.numel() - 1} "
            "(all but its last token): pass the state captured for this prompt, or none"
        )
    if prompt_state is not None and prompt_state.fingerprint is None:
        raise ValueError("prompt_state records no prompt fingerprint (it was not made by capture_prompt or "
                         "sample_group, or it is a prefix of a state): pass one they captured for this prompt, or none")
    if prompt_state is not None and prompt_state.fingerprint != prompt_fingerprint(group.prompt[:-1]):
        raise ValueError("prompt_state was captured for another prompt of the same length (its tokens differ from "
                         "this group's prompt[:-1]): pass the state captured for this prompt, or none")
    if context_parallel is not None:
        if plan not in ("detach", "exact"):
            raise ValueError(f"context parallelism shards the prompt state: use plan detach or exact, not {plan}")
        context_parallel.check_supported(model)
    if offload_state and plan not in ("detach", "exact"):
        raise ValueError(f"offload_state moves the prompt state to host memory: the {plan} plan has none; use "
                         "plan detach or exact")
    if isinstance(keep_prompt_graph, bool) or not isinstance(keep_prompt_graph, int) or keep_prompt_graph < 0:
        raise ValueError(f"keep_prompt_graph must be an integer >= 0 (capture chunks whose graph is kept), got "
                         f"{keep_prompt_graph!r}")
    if keep_prompt_graph and plan != "exact":
        raise ValueError(f"keep_prompt_graph keeps capture graphs for the exact plan's prompt backward; the {plan} "
                         "plan has none: pass keep_prompt_graph=0 or plan='exact'")
    if keep_prompt_graph and prompt_state is not None:
        raise ValueError("keep_prompt_graph keeps the graph of a capture backward_group runs itself, and a "
                         "prompt_state was passed (captured without one; its capture is already paid for): pass one or "
                         "the other")
    if keep_prompt_graph and context_parallel is not None:
        raise ValueError("keep_prompt_graph is not supported with context parallelism yet: pass keep_prompt_graph=0")
    if plan == "exact" and prompt_state is not None and not prompt_state.keep_boundaries:
        raise ValueError("the exact plan needs a prompt_state captured with keep_boundaries=True (the recurrent "
                         "state at every chunk boundary); pass one, or none")

    totals = GroupTotals.of(group.lengths, cfg)
    device = model.get_input_embeddings().weight.device
    # The loss runs in the accumulation dtype (fp32 for a bf16/fp16 model, precision.py), as do its inputs.
    dtype = accumulation_dtype(model.get_input_embeddings().weight.dtype)
    _check_ranges(group, dtype)
    stats: dict[str, float | int | str] = {"mode": plan, "prompt_tokens": group.prompt.numel(),
                                           "group_size": group.size, "checkpoint": checkpoint,
                                           "offload_state": offload_state, "keep_prompt_graph": keep_prompt_graph}
    if cfg.beta == 0 and not bool((group.advantages != 0).any()):
        # Every loss here is A times a function of the ratio (per token, or per sequence for gspo), plus the KL
        # term only when beta > 0: with every A = 0 the gradient is exactly zero, so the passes would add zeros.
        stats.update(prompt_state_bytes=prompt_state.nbytes() if prompt_state is not None else 0, capture_s=0.0,
                     replay_s=0.0, prompt_backward_s=0.0)
        return GroupResult(loss=0.0, logprobs=[], stats=stats, skipped="zero_advantage")
    prompt = group.prompt.to(device=device, dtype=torch.long)
    responses = [r.to(device=device, dtype=torch.long) for r in group.responses]
    advantages = group.advantages.to(device=device, dtype=dtype)

    def padded(values: list[torch.Tensor] | None, idx: list[int], shape: torch.Size) -> torch.Tensor | None:
        if values is None:
            return None
        out = torch.zeros(shape, dtype=dtype, device=device)
        for row, i in enumerate(idx):
            out[row, : values[i].numel()] = values[i].to(device=device, dtype=dtype)
        return out

    backwards = [0]  # micro-batches whose loss was built, hence backpropagated unless the check refused it

    def loss_fn(logp: torch.Tensor, mask: torch.Tensor, idx: list[int]) -> torch.Tensor:
        """This micro-batch's share of the group loss; logp/mask (k, T), idx: which responses."""
        backwards[0] += 1
        return response_loss(
            logp, mask, advantages[idx], totals, cfg,
            old_logp=padded(group.old_logprobs, idx, logp.shape),
            ref_logp=padded(group.ref_logprobs, idx, logp.shape),
        )

    params = list(model.parameters())
    had_grad = [p.grad is not None for p in params]
    try:
        with checkpointed_layers(model, enabled=checkpoint == "layers"):
            total, logprobs = _run_plan(model, plan, prompt, responses, loss_fn, chunk_size, micro_batch,
                                        token_chunk, prompt_state, context_parallel, offload_state, keep_prompt_graph,
                                        temperature, stats)
    except FloatingPointError as err:
        # A micro-batch refused before its backward; earlier micro-batches of this group did run theirs. Gradients
        # that did not exist before the call are dropped again; existing ones cannot be restored without a copy.
        for p, had in zip(params, had_grad):
            if not had:
                p.grad = None
        done = backwards[0] - 1
        if done > 0 and any(had_grad):
            raise FloatingPointError(f"{err}. The gradients that existed before this call hold the (finite) "
                                     f"contributions of this group's first {done} micro-batch(es): zero them before "
                                     "retrying") from None
        raise FloatingPointError(f"{err}. The gradients are as they were before this call") from None
    return GroupResult(loss=total, logprobs=logprobs, stats=stats)


def _run_plan(model, plan, prompt, responses, loss_fn, chunk_size, micro_batch, token_chunk, prompt_state,
              context_parallel, offload_state, keep_prompt_graph, temperature,
              stats) -> tuple[float, list[torch.Tensor]]:
    """The plan itself, phase by phase, with phase times and the state's size put in `stats`."""
    t0 = time.perf_counter()
    if plan in ("standard", "standard_batched"):
        total, logprobs = standard(model, prompt, responses, loss_fn, batched=plan == "standard_batched",
                                   temperature=temperature)
        stats.update(prompt_state_bytes=0, capture_s=0.0, replay_s=time.perf_counter() - t0, prompt_backward_s=0.0)
        return total, logprobs
    # The last prompt token is replayed with each response, so only prompt[:-1] is captured.
    state = prompt_state
    if state is None:  # the exact plan's state is captured as leaves (and, if asked, with its last chunks' graphs)
        state = capture_prompt(model, prompt[:-1], chunk_size, keep_boundaries=plan == "exact",
                               cp=context_parallel, offload=offload_state, leaves=plan == "exact",
                               keep_graph=keep_prompt_graph)
    else:
        if offload_state:
            state = state.offload(prompt.device)
        if plan == "exact":
            state = state.as_leaves()
    t1 = time.perf_counter()
    total, logprobs = replay_responses(model, prompt, state, responses, loss_fn, micro_batch, token_chunk,
                                       temperature)
    t2 = time.perf_counter()
    if plan == "exact":
        prompt_backward(model, prompt[:-1], state)
    t3 = time.perf_counter()
    stats.update(prompt_state_bytes=state.nbytes(), capture_s=t1 - t0, replay_s=t2 - t1, prompt_backward_s=t3 - t2)
    return total, logprobs
