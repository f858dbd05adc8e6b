"""What both entry points check before anything runs: the options with keyword settings applied
(`options_with`), the refusals that need the model and the options but no batch (`check_model_options`, which a
trainer also makes when it is built), and the batch's lengths and token ids against the model (`check_tokens`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from longstraw.admission.admission import check_architecture, is_recurrent
from longstraw.engine.hf.composite import text_config
from longstraw.engine.loss.config import LossConfig
from longstraw.engine.options import BackwardOptions
from longstraw.engine.router import RouterTap, top_k
from longstraw.models.architecture import hf


def options_with(options: BackwardOptions | None, settings: dict[str, Any], caller: str) -> BackwardOptions:
    """`options` with `settings` applied; an unknown keyword names the valid ones."""
    if options is not None and not isinstance(options, BackwardOptions):
        raise TypeError(f"options must be a longstraw.BackwardOptions, got {type(options).__name__}")
    unknown = sorted(set(settings) - set(BackwardOptions.names()))
    loss_keys = [name for name in unknown if name in LossConfig.names()]
    if loss_keys:
        what = "is a parameter" if len(loss_keys) == 1 else "are parameters"
        raise TypeError(f"{caller}: {', '.join(loss_keys)} {what} of the loss: pass loss=LossConfig(kind, "
                        f"{loss_keys[0]}=...) (longstraw.engine.loss.config.LossConfig)")
    if unknown:
        extra = ", prompt_state" if caller == "backward_group" else ", min_shared"
        raise TypeError(f"{caller} got an unexpected keyword argument {unknown[0]!r}; valid options: "
                        f"{', '.join(BackwardOptions.names())}{extra}")
    if options is None:
        return BackwardOptions(**settings)
    return replace(options, **settings) if settings else options


def check_model_options(model: torch.nn.Module, options: BackwardOptions) -> None:
    """The refusals that need the model and the options but no batch, made when a trainer is built: nothing to train,
    the exact plan's one-token chunks on a recurrent model, a router term on unrecordable router logits."""
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("no parameter of the model requires grad, so there is nothing to train: unfreeze the "
                         "parameters to train (param.requires_grad_(True)) or add an adapter")
    model_type = hf(model).config.model_type
    if options.plan.needs_chunk_boundaries and options.chunk_size == 1 and is_recurrent(model):
        raise ValueError(f"chunk_size=1 with the exact plan on {model_type}: its recurrent layers update their state "
                         "in place for one-token chunks, which the prompt backward cannot differentiate; use "
                         "chunk_size >= 2")
    if options.router_aux_coef:
        RouterTap(model)
        top_k(model)


def check_tokens(model: torch.nn.Module, longest: int, top_id: int, too_long: str) -> None:
    """The architecture for sequences of `longest` tokens, the largest token id `top_id` within the vocabulary, and
    `longest` within the model's positions (`too_long`: the refusal, with `{max_pos}` for the model's count)."""
    check_architecture(model, longest)
    vocab = hf(model).get_input_embeddings().num_embeddings
    if top_id >= vocab:
        raise ValueError(f"token id {top_id} is out of the model's vocabulary (size {vocab})")
    max_pos = getattr(text_config(model), "max_position_embeddings", None)  # a composite's text tower's
    if max_pos is not None and longest > max_pos:
        raise ValueError(too_long.format(max_pos=max_pos))
