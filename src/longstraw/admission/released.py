"""The released configs the sweep and the family checks run on: per model type, a released checkpoint's values that
change the computation (`released_configs.json`, with the checkpoint and the source each came from), and the config a
user's causal LM of a type holds (`sweep_config`: the class defaults with those values)."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

# The data file shipped beside this module.
_DATA: dict[str, Any] = json.loads(
    resources.files("longstraw.admission").joinpath("released_configs.json").read_text(encoding="utf-8"))
# model type -> the released checkpoint's config values (passed to `AutoConfig.for_model`)
RELEASED: dict[str, dict[str, Any]] = {t: e["values"] for t, e in _DATA["released"].items()}
# model type -> the checkpoint each `RELEASED` entry is read from (docs/architecture-verdicts.md names it per type)
RELEASED_CHECKPOINT: dict[str, str] = {t: e["checkpoint"] for t, e in _DATA["released"].items()}
# model type -> where its config.json was read (a public copy of it)
RELEASED_SOURCE: dict[str, str] = {t: e["source"] for t, e in _DATA["released"].items()}
# Types whose class defaults were checked against a released config.json and found to hold every value that changes
# the computation (model type -> the checkpoint, and where its config was read).
RELEASED_EQUALS_DEFAULTS: dict[str, str] = {t: e["checkpoint"] for t, e in _DATA["equals_defaults"].items()}
# Types whose released config.json was looked for and not found: their sweep runs on the class defaults.
RELEASED_NOT_FOUND: tuple[str, ...] = tuple(_DATA["not_found"])


def released_source(model_type: str) -> str:
    """Where the sweep's config of `model_type` comes from, for the table: a released checkpoint's values, the class
    defaults checked equal to one, or the class defaults."""
    if model_type in RELEASED:
        return f"values of {RELEASED_CHECKPOINT[model_type]}"
    if model_type in RELEASED_EQUALS_DEFAULTS:
        return f"class defaults, checked equal to {RELEASED_EQUALS_DEFAULTS[model_type].split(' (')[0]}"
    return "class defaults: no released config found" if model_type in RELEASED_NOT_FOUND else "class defaults"

# Types of the causal-LM mapping that are not decoder-only text models: encoders with a causal-LM head, encoder-decoder
# models' decoders, XLNet's permutation LM, and speech, music and image-captioning decoders. Listed, not counted.
NOT_DECODER_ONLY_TEXT = (
    "bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "blenderbot", "blenderbot-small", "camembert",
    "data2vec-text", "electra", "ernie", "git", "marian", "mbart", "megatron-bert", "moshi", "moss_transcribe_diarize",
    "musicgen", "musicgen_melody", "mvp", "pegasus", "plbart", "prophetnet", "rembert", "roberta",
    "roberta-prelayernorm", "roc_bert", "roformer", "trocr", "whisper", "xlm", "xlm-roberta", "xlm-roberta-xl",
    "xlnet", "xmod",
)


def causal_lm_types() -> list[str]:
    """Every model type of this transformers' causal-LM mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sweep_config(model_type: str) -> Any:
    """The config a user's causal LM of `model_type` holds: the class defaults with `RELEASED`'s values, and for a
    composite type whose causal-LM class is its text model (Qwen3.5, Llama-4, Mllama), that text model's config."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **RELEASED.get(model_type, {}))
    if getattr(config, "text_config", None) is None:
        return config
    try:
        with torch.device("meta"):
            built = transformers.AutoModelForCausalLM.from_config(config).config
    except Exception:  # the class cannot be built here (a missing optional dependency): check the config as given
        return config
    return built
