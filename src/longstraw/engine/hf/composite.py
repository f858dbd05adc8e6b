"""The text tower of a causal LM: the decoder LongStraw runs segments through and the config that describes it.

A multimodal checkpoint trained as text (Gemma-3 4B/12B/27B: `Gemma3ForConditionalGeneration`, model type `gemma3`)
wraps a plain text decoder (`model.model.language_model`, a `Gemma3TextModel`) beside a vision tower it does not run
on text-only input. Its top-level config holds the two sub-configs (`text_config`, `vision_config`) and no layer
count. LongStraw runs the text decoder itself, with the text config: on token ids alone, the wrapper's forward embeds
them with the decoder's own embedding and runs the decoder (and then its `lm_head`), so the two compute the same.
Every other supported family is its own text tower."""

from __future__ import annotations

from typing import Any

import torch

from longstraw.models.architecture import hf

# Model types whose base model wraps the text decoder as `language_model` (text-only input runs that decoder alone).
COMPOSITE_MODEL_TYPES = ("gemma3",)


def language_config(config: Any) -> Any:
    """The language model's part of `config`: the text config of a composite (multimodal) config, else `config`
    itself (admission reads it; for `COMPOSITE_MODEL_TYPES` it is `text_config`'s answer)."""
    return config.get_text_config() if getattr(config, "text_config", None) is not None else config


def text_config(model: torch.nn.Module) -> Any:
    """The config of `model`'s text decoder: `config.text_config` of a composite model, else `config` itself."""
    config = hf(model).config
    return config.get_text_config() if config.model_type in COMPOSITE_MODEL_TYPES else config


def text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder a segment runs through (embeddings, layers, final norm; no output projection): the base model,
    a composite model's language model, or Llama-4's `model`."""
    base = hf(model).base_model
    if hf(model).config.model_type == "llama4_text":
        # Llama4ForCausalLM names its decoder `model` but its base_model_prefix `language_model`, so `base_model` is
        # the causal LM itself (whose output has logits, no hidden states).
        return hf(model).model
    if hf(model).config.model_type not in COMPOSITE_MODEL_TYPES:
        return base
    language = getattr(base, "language_model", None)
    if not isinstance(language, torch.nn.Module):
        raise ValueError(f"{type(model).__name__} ({hf(model).config.model_type}) has no language_model in its "
                         "base model: LongStraw cannot find its text decoder")
    return language
