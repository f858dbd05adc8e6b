"""Which architectures LongStraw handles exactly, and the checks a model passes before any state is built:
supported and refused model types, eval mode (or train mode without randomness), uniform parameter dtype."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers

# The oldest transformers whose decoders take the cache protocol `state.cache.SegmentCache` speaks: 5.24 renamed the
# models' `past_key_values` argument to `cache` (5.17-5.23, checked, take ours as an unknown keyword and run every
# segment without it; 5.17's linear-attention layers also ask their cache through another interface).
MIN_TRANSFORMERS = (5, 24)


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers older than MIN_TRANSFORMERS before any model is built (the failure would otherwise
    surface deep in a capture as "chunk produced no state", or not at all)."""
    version = transformers.__version__ if version is None else version
    found = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if found < MIN_TRANSFORMERS:
        need = ".".join(map(str, MIN_TRANSFORMERS))
        raise ImportError(f"LongStraw needs transformers >= {need} (found {version}): older releases pass the cache "
                          f"under another name, so a prompt state would be silently ignored. Upgrade: "
                          f"pip install 'transformers>={need},<6'")


check_transformers()

# Model types whose every layer kind has a state adapter and a parity test (docs/design.md §4): full attention (GQA),
# sliding window, gated DeltaNet and KDA linear attention, Mamba2 SSM, MLA latent attention, DSA, MoE FFNs.
SUPPORTED_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_next", "mamba2", "falcon_h1", "deepseek_v3",
    "glm_moe_dsa", "kimi_linear", "qwen3_5_text", "cohere2", "glm4_moe", "nemotron_h",
)
# Those with conv/recurrent layers: their single-token kernels update state in place (see state/cache.py).
RECURRENT_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "mamba2", "falcon_h1", "kimi_linear", "nemotron_h")


def hf(module: torch.nn.Module) -> Any:
    """`module` itself, typed for its transformers interface (`config`, `get_input_embeddings()`, `base_model`,
    an attention module's `layer_idx`, ...). torch's stubs type every attribute a Module does not declare as
    `Tensor | Module`, which hides those (the model may also be a PEFT or FSDP2 wrapper); a no-op at run time."""
    return module


def stateless_layers(model: torch.nn.Module) -> frozenset[int]:
    """Indices of the decoder layers that keep no prompt state because they have no token mixer: Nemotron-H's
    blocks are each one of a Mamba2 mixer, attention, an MLP or an MoE (`config.layers_block_type`), and its MLP and
    MoE blocks read nothing from earlier positions. Every layer of the other supported families mixes tokens."""
    config = hf(model).config
    if config.model_type == "nemotron_h":
        return frozenset(i for i, kind in enumerate(config.layers_block_type) if kind in ("mlp", "moe"))
    else:
        return frozenset()


def logit_scale(model: torch.nn.Module) -> float:
    """The factor the model's forward multiplies its output projection by: Cohere2's `config.logit_scale`
    (`logits = lm_head(h) * logit_scale`, 0.0625 in Command R7B); 1.0 for every other supported family, whose forward
    returns the projection as it is. Every log-prob LongStraw computes from the output projection applies it: a
    missing factor would give other log-probs and a silently wrong gradient."""
    config = hf(model).config
    if config.model_type == "cohere2":
        return float(config.logit_scale)
    else:
        return 1.0


# Architectures refused for a reason beyond "not built yet": replaying them would be silently wrong.
_MAMBA1_WHY = (
    "transformers' torch path for Mamba-1 layers ignores the SSM state in multi-token continuations, so a replay "
    "from a captured state would be silently wrong"
)
REFUSED_MODEL_TYPES = {name: _MAMBA1_WHY for name in ("mamba", "falcon_mamba", "jamba", "zamba")}


def check_architecture(model: torch.nn.Module, max_length: int) -> None:
    """Raise ValueError unless LongStraw's state adapters handle this model exactly for `max_length` positions."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(
            f"architecture {model_type!r} is refused: {REFUSED_MODEL_TYPES[model_type]}. Supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {model_type!r} ({type(model).__name__}): LongStraw supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"{model_type} with final_logit_softcapping={softcap} is not supported: the "
            "chunked log-prob does not soft-cap logits; use a config with final_logit_softcapping=None"
        )
    if getattr(model, "base_model", None) is None or hf(model).get_output_embeddings() is None:
        raise ValueError(f"{type(model).__name__} is not a causal LM with a decoder and an output projection")
    if getattr(hf(model).get_output_embeddings(), "bias", None) is not None:
        raise ValueError("output projections with a bias are not supported")
    check_eval_mode(model)
    check_uniform_dtype(model)


def check_eval_mode(model: torch.nn.Module) -> None:
    """Refuse a model any of whose modules is in train() mode, naming the first one.

    `model.eval()` sets every submodule, but `model.layers[3].train()` (or a library that flips one module)
    leaves the root in eval mode: dropout there would make the gradients random and unreproducible."""
    for name, module in model.named_modules():
        if module.training:
            where = "the model" if not name else f"submodule {name!r} ({type(module).__name__})"
            dropout = [f"{n or name} p={m.p}" for n, m in module.named_modules()
                       if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
            why = f"dropout active: {', '.join(dropout[:3])}" if dropout else "train-only behaviour such as dropout"
            raise ValueError(f"{where} is in train() mode ({why}): call model.eval() first")


# Config fields whose non-zero value makes a forward in train() mode differ from one in eval() mode besides dropout
# modules and attention dropout (MoE routers that add noise to their logits while training).
_TRAIN_ONLY_CONFIG = ("router_jitter_noise",)


def active_dropout(model: torch.nn.Module) -> list[str]:
    """What a forward in train() mode would do that eval() does not, one entry per cause ("name p=0.1"): dropout
    modules with p > 0, attention modules whose `attention_dropout` is > 0 (transformers applies it only in
    training), and the train-only config fields above. Empty: train() and eval() compute the same numbers."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append(f"{name or 'the model'} p={module.p}")
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and rate > 0:
            found.append(f"{name or 'the model'}.attention_dropout={rate}")
    config = getattr(model, "config", None)
    for key in _TRAIN_ONLY_CONFIG:
        value = getattr(config, key, None)
        if isinstance(value, (int, float)) and value > 0:
            found.append(f"config.{key}={value}")
    return found


@contextmanager
def eval_mode_when_equal(model: torch.nn.Module) -> Iterator[None]:
    """Run the block with every module in eval() mode and restore each module's own mode after, for a model in
    train() mode whose train and eval forwards compute the same numbers (`active_dropout` is empty; else a
    ValueError names the causes). TRL trains in train() mode with dropout disabled."""
    active = active_dropout(model)
    if active:
        shown = ", ".join(active[:3]) + (f" and {len(active) - 3} more" if len(active) > 3 else "")
        raise ValueError(f"the model has train-only randomness ({shown}), so its train() forward differs from the "
                         "eval() forward LongStraw computes: set those to 0 (TRL's disable_dropout=True zeroes the "
                         "nn.Dropout modules; attention_dropout is set on each attention module from "
                         "config.attention_dropout) or call model.eval()")
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def check_uniform_dtype(model: torch.nn.Module) -> None:
    """Refuse floating-point parameters of mixed dtypes (e.g. one layer cast to float64), naming the first
    that differs from the input embeddings, instead of a matmul error deep inside a forward."""
    expected = hf(model).get_input_embeddings().weight.dtype
    # Parameters a family keeps in float32 on purpose (MoE router weights and biases of DeepSeek-V3, GLM-DSA,
    # Kimi when loaded in bfloat16 by from_pretrained): their modules cast for themselves.
    fp32_by_design = [*(getattr(model, "_keep_in_fp32_modules", None) or []),
                      *(getattr(model, "_keep_in_fp32_modules_strict", None) or [])]
    for name, p in model.named_parameters():
        if p.dtype == torch.float32 and any(key in name for key in fp32_by_design):
            continue
        if p.is_floating_point() and p.dtype != expected:
            raise ValueError(
                f"parameter {name!r} is {str(p.dtype).removeprefix('torch.')} but the model's embeddings are "
                f"{str(expected).removeprefix('torch.')}: mixed-dtype models are not supported; cast the whole model "
                f"with model.to({expected})"
            )
