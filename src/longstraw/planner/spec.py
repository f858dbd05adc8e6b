"""The planner's model description: `ModelSpec` (layer kinds, dimensions, parameter counts from a meta-device
instantiation: no weights are allocated), which `families.spec_from_config` reads from a transformers config;
`load_config` and the built-in descriptions of paper-scale models (`hybrid_27b`, `glm5_class`)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# Chunk length of the chunked gated-delta-rule / Mamba2 scan, whose per-chunk states autograd keeps.
LINEAR_SCAN_CHUNK = 64
MAMBA_SCAN_CHUNK = 256


def hybrid_27b():
    """A 27B-class gated-DeltaNet/attention hybrid in the style of Qwen3.5/3.6 (Qwen3-Next layer pattern):
    64 layers, 3 linear-attention layers per full-attention layer, hidden 5120, dense SwiGLU MLP 17408,
    GQA 24/4 heads of 256, linear attention 16 key / 48 value heads of 128, vocab 248320.

    Dimensions are our reading of public descriptions, not an official config; the parameter count comes out
    at 26.9B (computed by the planner from a meta-device instantiation)."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        hidden_size=5120, num_hidden_layers=64, intermediate_size=17408, num_attention_heads=24,
        num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
        max_position_embeddings=2**22,
    )


def glm5_class():
    """A GLM-5-class MLA + DSA mixture of experts: transformers' `GlmMoeDsaConfig` defaults (78 layers,
    hidden 6144, 256 routed experts of 2048 + 1 shared, 8 per token, MLA latent 512 + rope 64, indexer
    32 heads of 128, top-k 2048): 744B parameters, ~40B active."""
    from transformers import GlmMoeDsaConfig

    return GlmMoeDsaConfig(max_position_embeddings=2**22)


BUILTINS = {"hybrid-27b": hybrid_27b, "glm5-class": glm5_class}
BUILTIN_NAMES = tuple(BUILTINS)


def load_config(name: str):
    """A transformers config from a built-in name, a LongStraw preset, a directory or config.json, a .gguf file or a
    hub id. A local config.json is checked first (`sources.check_local_config`: custom code, unknown model type,
    head counts, non-finite numbers); a hub id that is not in the local cache fails in seconds when the hub cannot be
    reached. Never runs a model's own code.

    Raises ValueError, one line saying what to change, when nothing matches or the config is refused."""
    from transformers import AutoConfig

    from longstraw.choices import did_you_mean
    from longstraw.models.gguf_files import PACKAGED_GGUF, converted_gguf, resolve_model_path
    from longstraw.models.presets import PRESETS
    from longstraw.models.sources import check_local_config, read_config_json, validation_error

    if name in BUILTINS:
        return BUILTINS[name]()
    elif name in PRESETS:
        return PRESETS[name]()
    elif name in PACKAGED_GGUF or name.endswith(".gguf"):  # a packaged real model: the config of its converted copy
        path = resolve_model_path(name)
        if not os.path.isfile(path):
            raise ValueError(f"GGUF file {name!r} does not exist: give the path of a .gguf file")
        return AutoConfig.from_pretrained(converted_gguf(path), trust_remote_code=False)
    elif name.endswith(".json") and os.path.isfile(name):
        data = read_config_json(name)
        check_local_config(data, name)
        model_type = data.pop("model_type")
        data.pop("auto_map", None)
        try:
            return AutoConfig.for_model(model_type, **data)
        except Exception as err:  # transformers' validation of the fields' types and of their agreement
            raise validation_error(err, name) from None
    elif os.path.isdir(name):
        path = os.path.join(name, "config.json")
        if not os.path.exists(path):
            raise ValueError(f"directory {name!r} has no config.json")
        check_local_config(read_config_json(path), path)
        try:
            return AutoConfig.from_pretrained(name, trust_remote_code=False)
        except Exception as err:
            raise validation_error(err, path) from None
    return _hub_config(name, did_you_mean(name, [*BUILTIN_NAMES, *PRESETS, *PACKAGED_GGUF]))


def _hub_config(name: str, close: str):
    """A hub id's config: from the local cache, else from the hub after a quick check that it answers."""
    from transformers import AutoConfig

    from longstraw.models.presets import PRESETS
    from longstraw.models.sources import check_hub, hub_offline, remote_code_error

    accepted = (f"give a built-in description ({', '.join(BUILTIN_NAMES)}), a preset ({', '.join(PRESETS)}), a "
                "directory holding config.json, a config.json path, or a hub id reachable from here")
    if close and "/" not in name:  # a mistyped built-in name: refused without asking the hub
        raise ValueError(f"unknown model {name!r}{close}: {accepted}")
    for local_only in (True, False):
        try:
            return AutoConfig.from_pretrained(name, trust_remote_code=False, local_files_only=local_only)
        except Exception as err:  # transformers raises OSError, ValueError, HTTP errors ... for a bad id
            custom = remote_code_error(err, name)
            if custom is not None:
                raise custom from None
            if not local_only:
                raise ValueError(f"unknown model {name!r}{close}: {accepted} "
                                 f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})") from None
        if hub_offline():
            raise ValueError(f"unknown model {name!r}{close}: not in the local Hugging Face cache and HF_HUB_OFFLINE "
                             f"is set: {accepted}")
        try:
            check_hub(name)  # fails within seconds when the hub cannot be reached or has no such model
        except ValueError as err:
            raise ValueError(f"unknown model {name!r}{close}: {str(err).removeprefix(f'model {name!r} ')}") from None
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs from a config. `mixers[l]`: attention | sliding | chunked (Llama-4's chunked attention:
    a query sees its own `attention_chunk_size` positions; the state keeps every position, like full attention) |
    linear | lightning (MiniMax's lightning attention: one (heads, head_dim, head_dim) K^T V state, in the model's
    dtype, `lin_*` fields) | mamba | mla | dsa | conv (LFM2's short convolution: a (hidden, conv_kernel) window) |
    cca (ZAYA's compressed convolutional attention: K/V, a q/k convolution window of `conv_kernel` columns and one
    delayed value projection) | attention+mamba (Falcon-H1's parallel heads; Zamba2's hybrid layers: the shared
    attention block beside the layer's Mamba2 mixer) | mamba1 (a Mamba-1 mixer: `mamba_heads` is its inner width,
    `mamba_head_dim` 1) | none (Nemotron-H's MLP/MoE blocks); `mlps[l]`: dense | moe | none.
    `layer_kv[l]`: (key, value) elements per token of the K/V layer l keeps, where layers differ (per-layer head
    dims and K/V head counts, KV-shared layers keeping none: (0, 0)); empty: every attention layer keeps
    kv_heads x (head_dim + v_head_dim). Sizes are element counts."""

    name: str
    model_type: str
    hidden: int
    vocab: int
    mixers: tuple[str, ...]
    mlps: tuple[str, ...]
    params: int
    expert_params: int  # routed-expert parameters (expert-parallel under sharding)
    max_layer_params: int  # largest decoder layer without its routed experts (what FSDP gathers)
    tied: bool = False
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False
    attn_gate: bool = False  # Qwen3-Next/3.5 gated attention: q_proj also yields a sigmoid gate
    window: int = 0
    intermediate: int = 0
    moe_intermediate: int = 0
    experts_per_token: int = 0
    num_experts: int = 0
    shared_intermediate: int = 0
    lin_key_heads: int = 0
    lin_value_heads: int = 0
    lin_key_dim: int = 0
    lin_value_dim: int = 0
    conv_kernel: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 0
    mamba_chunk: int = MAMBA_SCAN_CHUNK  # the config's chunk size of the Mamba2 scan (it pads segments to it)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    index_heads: int = 0
    index_dim: int = 0
    index_layers: tuple[bool, ...] = field(default_factory=tuple)  # DSA: layer keeps its own indexer keys
    max_positions: int = 0  # the config's max_position_embeddings (0: none given)
    # No SDPA path in transformers (gpt-oss: its sinks): the standard plans' attention materialises its scores
    eager_attention: bool = False
    logit_softcap: bool = False  # final_logit_softcapping (Gemma-2): the log-prob pass keeps the cap's slope too
    layer_kv: tuple[tuple[int, int], ...] = field(default_factory=tuple)

    @property
    def num_layers(self) -> int:
        return len(self.mixers)


@contextmanager
def _plain_model_building() -> Iterator[None]:
    """transformers builds every model under DeepSpeed's partitioned ZeRO-3 initialisation while a ZeRO-3 config is
    live in the process (the TRL drop-in under DeepSpeed), which a meta-device model cannot go through: that config
    is set aside for the block (transformers keeps it behind one module-level weak reference)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    live = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = live


@dataclass(frozen=True)
class _MetaModel:
    """What a meta-device instantiation tells: parameter counts, which decoder layers hold routed experts, and
    whether the attention normalises q and k (a `q_norm`/`k_norm` module in a layer's attention)."""

    total: int
    expert: int
    max_layer: int  # largest decoder layer without its routed experts
    moe_layers: frozenset[int]
    qk_norm: bool
    eager_attention: bool  # the model class has no SDPA attention (transformers then runs its eager attention)
    # (key, value) widths per decoder layer of its attention's `k_proj` / `v_proj` (a `v_proj` of None or none at all:
    # the key's width, Gemma-4's `attention_k_eq_v` and ZAYA's split value projections); layers without a `k_proj`
    # (fused q/k/v projections, MLA, recurrent mixers) are absent
    kv_widths: dict[int, tuple[int, int]] = field(default_factory=dict)


def _meta_model(config) -> _MetaModel:
    """Counts from a meta-device model (no weights are allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with _plain_model_building(), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = expert = 0
    per_layer: dict[int, int] = {}
    moe_layers: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=True):  # a tied weight once
        total += p.numel()
        is_expert = ".experts." in name
        if is_expert:
            expert += p.numel()
        m = re.search(r"\.layers\.(\d+)\.", name)
        if m and is_expert:
            moe_layers.add(int(m.group(1)))
        elif m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + p.numel()
    qk_norm = any(re.search(r"\.(self_attn|attention|attn)\.(q_norm|k_norm|q_layernorm|k_layernorm)\.", name)
                  for name, _ in model.named_parameters())
    return _MetaModel(total, expert, max(per_layer.values(), default=0), frozenset(moe_layers), qk_norm,
                      not getattr(model, "_supports_sdpa", True), _kv_widths(model))


def _kv_widths(model) -> dict[int, tuple[int, int]]:
    """`_MetaModel.kv_widths`: per decoder layer, the output widths of the first attention `k_proj` in it and of its
    sibling `v_proj` (an indexer's key projection is not the attention's). Modules shared by several layers (Zamba2's
    shared attention block) are listed under each layer."""
    import torch

    widths: dict[int, tuple[int, int]] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, module in modules.items():
        m = re.search(r"\.layers\.(\d+)\.(?:.*\.)?k_proj$", name)
        if not m or "indexer" in name or int(m.group(1)) in widths or not isinstance(module, torch.nn.Linear):
            continue
        value = modules.get(name[: -len("k_proj")] + "v_proj")
        widths[int(m.group(1))] = (module.out_features,
                                   value.out_features if isinstance(value, torch.nn.Linear) else module.out_features)
    return widths
