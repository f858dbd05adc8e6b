"""Which architectures LongStraw handles exactly, and the checks a model passes before any state is built:
supported and refused model types, eval mode (or train mode without randomness), uniform parameter dtype."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers
from torch.distributed.tensor import DTensor

# The oldest transformers LongStraw runs on at all (llama, qwen2, qwen3, mistral, gemma3_text and the other attention
# families); some families need a later one (`MIN_TRANSFORMERS_BY_MODEL_TYPE`, checked by `check_architecture`).
MIN_TRANSFORMERS = (5, 5, 3)


def _version(version: str) -> tuple[int, ...]:
    """"5.24.1.dev0" -> (5, 24, 1): the release numbers, padded to three."""
    found = [int(x) for x in re.findall(r"\d+", version)[:3]]
    return tuple(found + [0] * (3 - len(found)))


def _show(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version[:2] if version[2:] == (0,) else version))


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers older than MIN_TRANSFORMERS before any model is built."""
    version = transformers.__version__ if version is None else version
    if _version(version) < MIN_TRANSFORMERS:
        need = _show(MIN_TRANSFORMERS)
        raise ImportError(f"LongStraw needs transformers >= {need} (found {version}): older releases speak another "
                          f"cache protocol, so a prompt state would be silently ignored. Upgrade: "
                          f"pip install 'transformers>={need},<6'")


check_transformers()


# The name each decoder or causal-LM class takes its cache under (`cache_keyword`), read once per class.
_CACHE_KEYWORDS: dict[type, str | None] = {}


def cache_keyword(module: torch.nn.Module) -> str:
    """The name under which `module`'s forward (a transformers decoder or causal LM) takes its cache object, read from
    the forward's signature once per class: `cache`, or in releases up to 5.23 `past_key_values` (Mamba2:
    `cache_params`). Refused: a forward naming none, which would drop the cache into **kwargs and ignore the prompt."""
    cls = type(module)
    if cls not in _CACHE_KEYWORDS:
        parameters = inspect.signature(cls.forward).parameters
        # >= 5.24 | older releases | older Mamba2
        _CACHE_KEYWORDS[cls] = next((n for n in ("cache", "past_key_values", "cache_params") if n in parameters), None)
    name = _CACHE_KEYWORDS[cls]
    if name is None:
        raise TypeError(f"{type(module).__name__}.forward takes no cache argument LongStraw knows (cache, "
                        f"past_key_values, cache_params) on transformers {transformers.__version__}: LongStraw "
                        "cannot hand it a prompt state")
    return name


# Model types whose every layer kind has a state adapter and a parity test (docs/design.md §4): full attention (GQA),
# sliding window, gated DeltaNet and KDA linear attention, Mamba2 SSM, MLA latent attention, DSA, MoE FFNs.
SUPPORTED_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_next", "mamba2", "falcon_h1", "deepseek_v3",
    "glm_moe_dsa", "kimi_linear", "qwen3_5_text", "cohere2", "glm4_moe", "nemotron_h", "gemma3", "gpt_oss",
    "gemma2", "granite", "granitemoe", "granitemoeshared", "cohere", "granitemoehybrid",
    "mamba", "falcon_mamba", "jamba",
    "stablelm", "nemotron", "zamba2", "llama4_text", "minimax", "gemma4_text",
    "qwen3_moe", "mixtral", "qwen2_moe", "olmoe",
    # admitted through their verification (`verify`), kept on the list by tests/models/test_families.py
    "phi3", "phimoe", "olmo", "olmo2", "olmo3", "smollm3", "seed_oss", "exaone4", "lfm2", "starcoder2", "gpt_neox",
    "glm", "glm4", "glm4_moe_lite", "apertus", "arcee", "bitnet", "hunyuan_v1_dense", "hunyuan_v1_moe", "ernie4_5",
    "ernie4_5_moe", "dots1", "minimax_m2", "deepseek_v2", "deepseek_v32", "bamba", "ministral", "olmo_hybrid",
    "qwen3_5_moe_text", "gpt2", "gemma", "helium", "phi",
)
# Those with conv/recurrent layers: their single-token kernels update state in place (see engine/hf/cache.py).
RECURRENT_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "mamba2", "falcon_h1", "kimi_linear", "nemotron_h", "zamba2",
                         "mamba", "falcon_mamba", "jamba", "lfm2", "bamba", "olmo_hybrid", "qwen3_5_moe_text",
                         "minimax", "granitemoehybrid")


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
    if config.model_type != "nemotron_h":
        return frozenset()
    return frozenset(i for i, kind in enumerate(config.layers_block_type) if kind in ("mlp", "moe"))


def logit_scale(model: torch.nn.Module) -> float:
    """The one multiplicative factor the causal LM's forward applies between the decoder's final hidden states (what
    `run_segment` returns) and the logits it returns, read from the config of the model's own class (a multimodal
    wrapper whose forward applies none gets 1.0); a division (Granite's `logits_scaling`, MiniCPM3's, applied to the
    hidden states before an output projection without bias) is returned as its inverse. The families and their
    factors: docs/architectures.md. Every log-prob LongStraw computes from the output projection applies it: a missing
    factor would give other log-probs and a silently wrong gradient. A soft-cap after it is `logit_softcap`."""
    config = hf(model).config
    model_type = config.model_type
    if model_type in ("cohere", "cohere2", "cohere2_moe"):
        return float(config.logit_scale)
    elif model_type in ("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa",
                        "granitemoe_swa", "minicpm3"):
        return 1.0 / float(config.logits_scaling)
    elif model_type == "hyperclovax":
        return float(config.logits_scaling)
    elif model_type == "falcon_h1":
        return float(config.lm_head_multiplier)
    else:
        return 1.0


def logit_softcap(model: torch.nn.Module) -> float | None:
    """The final-logit soft-cap the causal LM's forward applies after `logit_scale`'s factor: cap * tanh(logits / cap)
    with cap = `config.final_logit_softcapping` (Gemma-2: 30.0; Gemma-3 text configs set none), None without one.
    Read from the config of the model's own class, as its forward reads it."""
    cap = getattr(hf(model).config, "final_logit_softcapping", None)
    return None if cap is None else float(cap)


# The model types that need a later transformers than MIN_TRANSFORMERS: the oldest release with which LongStraw
# computes them exactly (each release from it to constraints.txt's pin passed the family's parity tests), and what an
# older one does. Every other supported type runs on MIN_TRANSFORMERS.
_GATED_DELTANET_ZERO = ("in 5.5-5.6 its gated DeltaNet layers start every multi-token segment from a zero state (no "
                        "initial recurrent state, a zero-padded conv), so replays would ignore the prompt")
_LATENT_NOT_CACHED = "up to {} its MLA layers cache per-head keys and values, not the latent LongStraw keeps"
MIN_TRANSFORMERS_BY_MODEL_TYPE: dict[str, tuple[tuple[int, int, int], str]] = {
    "qwen3_next": ((5, 7, 0), _GATED_DELTANET_ZERO),
    "qwen3_5_text": ((5, 7, 0), _GATED_DELTANET_ZERO),
    "mamba2": ((5, 18, 0), "up to 5.12 a Mamba2 layer continues a state only one token at a time (a longer "
                           "segment runs the one-token update or starts from a zero state); 5.13-5.14 keep its SSM "
                           "state in the model's dtype, not the float32 of the full forward's scan; on 5.15-5.17 "
                           "replays stay 2.6e-7 from the full forward where transformers' own chunked continuation "
                           "is exact, which LongStraw's parity tests do not accept"),
    "nemotron_h": ((5, 15, 0), "up to 5.14 its Mamba2 blocks do not continue a state over a multi-token segment "
                               "exactly (5.13-5.14: replays differ from the full forward by 7e-4)"),
    "deepseek_v3": ((5, 15, 0), _LATENT_NOT_CACHED.format("5.14")),
    "falcon_h1": ((5, 17, 0), "up to 5.16 its decoder layers do not pass LongStraw's arguments on to the attention "
                              "kernel"),
    "kimi_linear": ((5, 17, 0), "transformers has a Kimi Linear model from 5.17 on"),
    "glm_moe_dsa": ((5, 18, 0), _LATENT_NOT_CACHED.format("5.17")),
    "zamba2": ((5, 24, 0), "its Mamba2 layers' state continuation and its shared attention blocks are verified on "
                           "5.24 only"),
    "llama4_text": ((5, 24, 0), "its chunked attention layers and Llama4ForCausalLM's decoder are verified on 5.24 "
                                "only"),
    "minimax": ((5, 24, 0), "its lightning attention's state continuation (get/set_linear_cache) is verified on 5.24 "
                            "only"),
    "gemma4_text": ((5, 24, 0), "its KV-shared layers and per-layer head dims are verified on 5.24 only"),
    # Mamba-1 layers run LongStraw's own scan (engine/hf/mamba1.py) inside transformers' modules
    **{name: ((5, 24, 0), "its Mamba-1 layers are not verified on older releases")
       for name in ("mamba", "falcon_mamba", "jamba")},
}


def transformers_too_old(model_type: str, version: str | None = None) -> str | None:
    """Why this transformers (or `version`) is too old for `model_type`, with what to install; None if recent enough."""
    version = transformers.__version__ if version is None else version
    need, why = MIN_TRANSFORMERS_BY_MODEL_TYPE.get(model_type, ((0, 0, 0), ""))  # other types: none needed
    if _version(version) >= need:
        return None
    return (f"{model_type} needs transformers >= {_show(need)} for LongStraw (found {version}): {why}. "
            f"Upgrade: pip install 'transformers>={_show(need)},<6'")


@functools.cache
def check_transformers_for(model_type: str) -> None:
    """Raise ValueError (`transformers_too_old`'s message) where this transformers is too old for `model_type`: every
    segment LongStraw runs checks it first (once per type), so sampling or a capture is refused as early as
    `check_architecture` refuses `backward_group`."""
    why = transformers_too_old(model_type)
    if why is not None:
        raise ValueError(why)


# Architectures refused for a reason beyond "not built yet": replaying them would be silently wrong.
REFUSED_MODEL_TYPES = {
    "zamba": "its Mamba layers (several SSM heads per layer) are not wired to LongStraw's Mamba-1 scan, and "
             "transformers' torch path for them ignores the SSM state in multi-token continuations, so a replay "
             "from a captured state would be silently wrong",
}


# The transformers release CI tests every type of SUPPORTED_MODEL_TYPES on (constraints.txt's pin), and the types
# `make test-oldest` also tests on MIN_TRANSFORMERS. Elsewhere a type off that second list is checked like any other.
CI_TRANSFORMERS = "5.24.0"
TESTED_ON_OLDEST = (
    "llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_next", "mamba2", "falcon_h1", "deepseek_v3",
    "glm_moe_dsa", "kimi_linear", "qwen3_5_text", "cohere2", "glm4_moe", "nemotron_h",
)


def on_the_ci_list(model_type: str, version: str | None = None) -> bool:
    """Whether CI's parity tests cover `model_type` on this transformers (or `version`): then the check is skipped."""
    version = transformers.__version__ if version is None else version
    return model_type in SUPPORTED_MODEL_TYPES and (model_type in TESTED_ON_OLDEST or version == CI_TRANSFORMERS)


def known_recurrence(model_type: str) -> bool | None:
    """Whether some layer of a `model_type` model keeps a conv or recurrent state, where the type says it: True on
    `RECURRENT_MODEL_TYPES`, False for any other type on CI's list (`on_the_ci_list`), None for a type only the check
    of its config measures (`longstraw.admission.admission.is_recurrent`)."""
    if model_type in RECURRENT_MODEL_TYPES:
        return True
    return False if on_the_ci_list(model_type) else None


def check_eval_mode(model: torch.nn.Module) -> None:
    """Refuse a model any of whose modules is in train() mode, naming the first one. `model.eval()` sets every
    submodule, but `model.layers[3].train()` (or a library that flips one module) leaves the root in eval mode: dropout
    there would make the gradients random and unreproducible."""
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
    """What a forward in train() mode would do that eval() does not, one entry per cause ("name p=0.1"): dropout modules
    with p > 0; a module's rate attribute above 0 that transformers applies only in training through
    `nn.functional.dropout` (`attention_dropout`, OPT's and BioGPT's `dropout` and `activation_dropout`: any attribute
    named `*dropout` or `*layerdrop`); and the train-only config fields above. Empty: train() and eval() agree."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append(f"{name or 'the model'} p={module.p}")
        for key, rate in vars(module).items():
            if (key.endswith(("dropout", "layerdrop")) and isinstance(rate, (int, float))
                    and not isinstance(rate, bool) and rate > 0):
                found.append(f"{name or 'the model'}.{key}={rate}")
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
                         "nn.Dropout modules; the rates modules read from the config, such as attention_dropout or "
                         "OPT's dropout, are set by loading with them at 0: from_pretrained(..., dropout=0.0)) or "
                         "call model.eval()")
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
        if isinstance(p, DTensor):
            continue  # an FSDP2 shard at rest: FSDP gathers it in its mixed-precision policy's dtype before any use
        if p.is_floating_point() and p.dtype != expected:
            raise ValueError(
                f"parameter {name!r} is {str(p.dtype).removeprefix('torch.')} but the model's embeddings are "
                f"{str(expected).removeprefix('torch.')}: mixed-dtype models are not supported; cast the whole model "
                f"with model.to({expected})"
            )
