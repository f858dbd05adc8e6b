"""Admission: whether LongStraw runs a model, decided before any compute (`load_model`, `backward_group`, integrations).

A model type on CI's list on this transformers (`architecture.on_the_ci_list`) is admitted at once; a type refused for
a known missing mechanism (`architecture.REFUSED_MODEL_TYPES`) or too new for this transformers is refused at once;
every other model is admitted or refused by the check of its own config (`verify.verdict_for`: a tiny float64 copy
against transformers, measured once per config and version and cached)."""

from __future__ import annotations

import torch

from longstraw.admission import verify
from longstraw.engine.hf.composite import language_config
from longstraw.models.architecture import (
    REFUSED_MODEL_TYPES,
    check_eval_mode,
    check_transformers_for,
    check_uniform_dtype,
    hf,
    known_recurrence,
    on_the_ci_list,
)


def admit(model: torch.nn.Module) -> None:
    """Raise ValueError unless this model's architecture is admitted (the module docstring says how); composite models
    whose text tower LongStraw does not find are refused at once."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) is None:
        raise ValueError(f"{type(model).__name__} has no transformers config with a model_type: not a transformers "
                         "causal LM")
    model_type = language_config(config).model_type
    why = verify.composite_refusal(config)
    if why is not None:
        raise ValueError(f"{type(model).__name__}: {why}")
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(f"architecture {model_type!r} is refused: {REFUSED_MODEL_TYPES[model_type]}")
    check_transformers_for(model_type)
    if on_the_ci_list(model_type):
        return
    verdict = verify.verdict_for(config)
    if not verdict.admitted:
        raise ValueError(verdict.refusal())


def is_recurrent(model: torch.nn.Module) -> bool:
    """Whether some layer of `model` keeps a conv or recurrent state: what its type says (`known_recurrence`), else
    what the check of its config measured (`verify`, cached). The public entry points pass it to the engine."""
    config = hf(model).config
    known = known_recurrence(config.model_type)
    return verify.verdict_for(config).recurrent if known is None else known


def check_architecture(model: torch.nn.Module, max_length: int) -> None:
    """Raise ValueError unless LongStraw computes this model exactly (`admit`) and it is ready for a step: a causal
    LM with an output projection, in eval mode, with one parameter dtype."""
    admit(model)
    if getattr(model, "base_model", None) is None or hf(model).get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} is not a causal LM with a decoder and an output projection")
    check_eval_mode(model)
    check_uniform_dtype(model)
