"""The planner's model description: `ModelSpec` (layer kinds, dimensions, parameter counts from a meta-device
instantiation: no weights are allocated) read from a transformers config by `spec_from_config`; `load_config` and
the built-in descriptions of paper-scale models (`hybrid_27b`, `glm5_class`)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypedDict

# Chunk length of the chunked gated-delta-rule / Mamba2 scan, whose per-chunk states autograd keeps.
LINEAR_SCAN_CHUNK = 64
MAMBA_SCAN_CHUNK = 256


# ---------------------------------------------------------------- built-in model descriptions


def hybrid_27b():
    """A 27B-class gated-DeltaNet/attention hybrid in the style of Qwen3.5/3.6 (Qwen3-Next layer pattern):
    64 layers, 3 linear-attention layers per full-attention layer, hidden 5120, dense SwiGLU MLP 17408,
    GQA 24/4 heads of 256, linear attention 16 key / 48 value heads of 128, vocab 248320.

    Dimensions are our reading of public descriptions, not an official config; the parameter count comes out
    at 26.9B (computed by the planner from a meta-device instantiation).
    """
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


BUILTIN_NAMES = ("hybrid-27b", "glm5-class")


def read_config_json(path: str) -> dict[str, Any]:
    """A config.json's object; ValueError naming the file and line when it is not UTF-8 JSON or not an object."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte 0x{raw[err.start]:02x}): save it as UTF-8") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{err.lineno}: not valid JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object: not a transformers config.json")
    return data


def load_config(name: str):
    """A transformers config from a built-in name, a LongStraw preset, a directory or config.json, or a hub id.

    Raises ValueError (with what is accepted) when nothing matches.
    """
    from longstraw.choices import did_you_mean
    from longstraw.models.gguf_files import PACKAGED_GGUF, converted_gguf, resolve_model_path
    from longstraw.models.presets import PRESETS

    if name == "hybrid-27b":
        return hybrid_27b()
    elif name == "glm5-class":
        return glm5_class()
    elif name in PRESETS:
        return PRESETS[name]()
    elif name in PACKAGED_GGUF or name.endswith(".gguf"):  # a packaged real model: the config of its converted copy
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(converted_gguf(resolve_model_path(name)))
    elif name.endswith(".json") and os.path.isfile(name):
        from transformers import AutoConfig

        data = read_config_json(name)
        if "model_type" not in data:
            raise ValueError(f"{name} has no model_type: not a transformers config.json")
        check_head_counts(data, name)
        model_type = data.pop("model_type")
        return AutoConfig.for_model(model_type, **data)
    elif os.path.isdir(name):
        from transformers import AutoConfig

        path = os.path.join(name, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"directory {name!r} has no config.json")
        check_head_counts(read_config_json(path), path)
        return AutoConfig.from_pretrained(name)
    else:
        from transformers import AutoConfig

        close = did_you_mean(name, [*BUILTIN_NAMES, *PRESETS, *PACKAGED_GGUF])
        accepted = (f"give a built-in description ({', '.join(BUILTIN_NAMES)}), a preset ({', '.join(PRESETS)}), a "
                    "directory holding config.json, a config.json path, or a hub id reachable from here")
        if close and "/" not in name:  # a mistyped built-in name: refused without asking the hub
            raise ValueError(f"unknown model {name!r}{close}: {accepted}")
        try:
            return AutoConfig.from_pretrained(name)
        except Exception as err:  # transformers raises OSError, ValueError, HTTP errors ... for a bad id
            raise ValueError(
                f"unknown model {name!r}{close}: {accepted} "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
            ) from None


# ---------------------------------------------------------------- model description


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
    kv_heads x (head_dim + v_head_dim).
    Sizes are element counts."""

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
    layer_kv: tuple[tuple[int, int], ...] = field(default_factory=tuple)

    @property
    def num_layers(self) -> int:
        return len(self.mixers)


PLANNER_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_next", "qwen3_5_text", "mamba2", "falcon_h1",
    "deepseek_v3", "glm_moe_dsa", "kimi_linear", "cohere2", "glm4_moe", "nemotron_h", "gpt_oss", "mamba",
    "falcon_mamba", "jamba",
)


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
    seen: set[int] = set()
    for name, p in model.named_parameters(remove_duplicate=True):
        if id(p) in seen:
            continue
        seen.add(id(p))
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


class _AttentionDims(TypedDict):
    heads: int
    kv_heads: int
    head_dim: int


def _attention_dims(c) -> _AttentionDims:
    heads = c.num_attention_heads
    return {
        "heads": heads, "kv_heads": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
    }


def _moe_layers(c, n: int) -> tuple[str, ...]:
    """DeepSeek-style: the first `first_k_dense_replace` layers dense, the rest MoE (or `mlp_layer_types`)."""
    types = getattr(c, "mlp_layer_types", None)
    if types:
        return tuple("moe" if t == "sparse" else "dense" for t in types)
    k = getattr(c, "first_k_dense_replace", 0) or 0
    return tuple("dense" if i < k else "moe" for i in range(n))


class _MlaDims(TypedDict):
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    moe_intermediate: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_dim: int
    qk_nope_dim: int
    v_head_dim: int


def _mla_dims(c) -> _MlaDims:
    """Latent attention (MLA) dimensions and the dense/expert MLP widths, which Kimi-Linear, DeepSeek-V3 and GLM-DSA
    configs spell alike (their expert counts are spelled differently)."""
    return {
        "heads": c.num_attention_heads, "kv_heads": c.num_attention_heads,
        "head_dim": c.qk_nope_head_dim + c.qk_rope_head_dim, "intermediate": c.intermediate_size,
        "moe_intermediate": c.moe_intermediate_size, "q_lora_rank": c.q_lora_rank or 0,
        "kv_lora_rank": c.kv_lora_rank, "qk_rope_dim": c.qk_rope_head_dim, "qk_nope_dim": c.qk_nope_head_dim,
        "v_head_dim": c.v_head_dim,
    }


def _nemotron_h_blocks(kinds: list[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(mixers, mlps) of Nemotron-H's blocks, each of which is one token mixer or one MLP (`layers_block_type`)."""
    mixers, mlps = [], []
    for kind in kinds:
        if kind == "linear_attention":  # transformers' name for its Mamba2 blocks
            mixers.append("mamba")
            mlps.append("none")
        elif kind == "full_attention":
            mixers.append("attention")
            mlps.append("none")
        elif kind == "mlp":
            mixers.append("none")
            mlps.append("dense")
        elif kind == "moe":
            mixers.append("none")
            mlps.append("moe")
        else:
            raise ValueError(f"unknown Nemotron-H block type {kind!r} (known: linear_attention, full_attention, mlp, "
                             "moe)")
    return tuple(mixers), tuple(mlps)


# Families read generically from their config (`_layer_mixers`, `_generic_attention_dims`, `_generic_mlps`), each
# pinned against its captured state by tests/planner/test_families.py. Plain attention layers (full or sliding)
# with a dense or routed-expert MLP: K and V of num_key_value_heads x head_dim per token (attention sinks, partial
# rotary, q/k norms, logit scales and multipliers change no state).
ATTENTION_MODEL_TYPES = (
    "apertus", "apertus1p5_text", "arcee", "aria_text", "beam", "biogpt", "bitnet", "cohere", "cohere2_moe", "cwm",
    "diffllama", "doge", "ernie4_5", "ernie4_5_moe", "exaone", "exaone4", "exaone_moe", "flex_olmo", "flint", "gemma",
    "gemma2", "glm", "glm4", "gpt_bigcode", "gpt_neox", "gpt_neox_japanese", "granite", "granite_swa", "granitemoe",
    "granitemoe_swa", "granitemoeshared", "helium", "hy_v3", "hyperclovax", "internlm3", "iquestcoder", "jais2",
    "jetmoe", "kolibri1", "laguna", "mellum", "minimax_m2", "ministral3", "mixtral", "modernbert-decoder", "moshi",
    "nanochat",
    "nemotron", "olmo", "olmo2", "olmo3", "olmoe", "persimmon", "phi", "phi3", "phimoe", "qwen2_moe", "qwen3_moe",
    "sarvam_moe", "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2", "vaultgemma",
    # Learned or rotary positions under GPT-2-era field names (`n_head`, `n_embd`, `n_layer`: transformers' attribute
    # maps read them as the common names; fused q/k/v projections: K/V of hidden / heads per head).
    "codegen", "ctrl", "gpt2", "gptj", "opt",
    "afmoe", "dots1", "hunyuan_v1_dense", "hunyuan_v1_moe", "ministral",
    # Llama-4's chunked layers (`chunked`); Gemma-4's per-layer head dims and K/V head counts and its KV-shared layers
    # (`layer_kv`); MiMo-V2-Flash's sliding layers with twice the K/V heads and a V head dim of its own (`layer_kv`);
    # MiniMax-M3's full-attention layers (its indexer's sparse layers are refused by `_layer_mixers`).
    "gemma4_text", "gemma4_unified_text", "llama4_text", "mimo_v2_flash", "minimax_m3_vl_text",
)
# Latent attention (MLA: the compressed c_kv and the shared RoPE key per token), read like DeepSeek-V3. LongCat-Flash:
# two MLA sublayers per decoder layer, each its own cache layer (`num_hidden_layers` = 2 x `num_layers`).
MLA_MODEL_TYPES = ("axk1", "glm4_moe_lite", "minicpm3", "sarvam_mla", "youtu", "deepseek_v2", "longcat_flash")
# MLA with DSA indexer keys on the layers whose `indexer_types` entry is not "shared" (every layer without it).
DSA_MODEL_TYPES = ("deepseek_v32", "axk2", "hy_v4")
# Mamba2 mixers (`linear_attention` in `layer_types`) and attention layers, Falcon-H1's Mamba2 field names.
MAMBA2_HYBRID_TYPES = ("bamba", "granitemoehybrid")
# Gated-DeltaNet layers (`linear_attention`) and attention layers, Qwen3-Next's field names.
GATED_DELTANET_TYPES = ("qwen3_5_moe_text", "olmo_hybrid", "lara_mini")
# LFM2's gated short convolutions (`conv` layers: a (hidden, conv_L_cache) window, no recurrent state) and
# attention layers.
SHORT_CONV_TYPES = ("lfm2", "lfm3")
# Lightning attention (`linear_attention` layers: one K^T V state per head, no conv window) and attention layers.
LIGHTNING_TYPES = ("minimax",)
# Mamba2 layers (`linear_attention`) and hybrid layers: a Mamba2 mixer beside one of the shared attention blocks.
SHARED_BLOCK_TYPES = ("zamba2",)
# Compressed convolutional attention on every layer (`hybrid`).
CCA_TYPES = ("zaya",)

# Configs carrying a `sliding_window` that transformers' attention never reads (Moshi's: full causal attention).
WINDOW_UNUSED_TYPES = ("moshi",)

_EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_EXPERTS_PER_TOKEN = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "moe_topk", "top_k")
_SHARED_EXPERT_COUNTS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
# The dense MLP's width (Llama-4's dense layers: `intermediate_size_mlp`, its `intermediate_size` being the experts';
# OPT `ffn_dim`, CTRL `dff`, GPT-2 style `n_inner`, None there for 4 x hidden) and the routed experts'.
_DENSE_WIDTHS = ("intermediate_size_mlp", "intermediate_size", "ffn_dim", "ffn_hidden_size", "dff", "n_inner")
_EXPERT_WIDTHS = ("moe_intermediate_size", "expert_ffn_hidden_size")
_SHARED_EXPERT_WIDTHS = ("shared_expert_intermediate_size", "shared_intermediate_size",
                         "moe_shared_expert_intermediate_size")


def _first(c, names: tuple[str, ...]) -> int:
    """The first of `names` the config sets to a positive int (0 when none does)."""
    for name in names:
        value = getattr(c, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _layer_mixers(c, mt: str, linear: str = "") -> tuple[tuple[str, ...], int]:
    """(mixer per layer, sliding window) from `layer_types` (`full_attention`, `sliding_attention`; `linear_attention`
    as `linear`; `conv` for the short-convolution families), or without it every layer full attention, or sliding
    where the config sets `sliding_window` and does not turn it off (`use_sliding_window`). ValueError naming a layer
    type the planner does not model."""
    n = c.num_hidden_layers
    window = 0 if mt in WINDOW_UNUSED_TYPES else getattr(c, "sliding_window", None) or 0
    types = list(getattr(c, "layer_types", None) or [])
    if not types:
        sliding = window and getattr(c, "use_sliding_window", True) is not False
        return ("sliding" if sliding else "attention",) * n, window
    mixers = []
    for t in types:
        if t in ("full_attention", "attention"):
            mixers.append("attention")
        elif t == "sliding_attention" and window:
            mixers.append("sliding")
        elif t == "chunked_attention":
            mixers.append("chunked")
        elif t == "linear_attention" and linear:
            mixers.append(linear)
        elif t == "conv" and mt in SHORT_CONV_TYPES:
            mixers.append("conv")
        else:
            raise ValueError(f"{mt}: the planner does not model layer type {t!r} of this family (it models "
                             "full_attention, sliding_attention with a sliding_window, chunked_attention"
                             + (f", linear_attention as {linear}" if linear else "")
                             + (", conv" if mt in SHORT_CONV_TYPES else "") + ")")
    return tuple(mixers), window


class _GenericAttentionDims(TypedDict):
    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int


def _generic_attention_dims(c) -> _GenericAttentionDims:
    """Query heads, K/V heads (one for multi-query configs), the head dim (`head_dim`, else `kv_channels`, else
    hidden / heads) and the V head dim where the config gives a different one."""
    heads = c.num_attention_heads
    kv = 1 if getattr(c, "multi_query", False) else getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or getattr(c, "kv_channels", None) or c.hidden_size // heads
    return {"heads": heads, "kv_heads": kv, "head_dim": head_dim,
            "v_head_dim": getattr(c, "v_head_dim", None) or head_dim}


def _layer_kv(c, dims: _GenericAttentionDims, meta: _MetaModel) -> tuple[tuple[int, int], ...]:
    """`ModelSpec.layer_kv`: each layer's (key, value) widths from its attention's projections (`kv_widths`), none for
    the layers that reuse an earlier layer's K/V (Gemma-4's `num_kv_shared_layers`), the config's dims for layers
    without a `k_proj`; empty where every layer keeps the config's kv_heads x (head_dim + v_head_dim)."""
    from longstraw.engine.state.sharing import kv_shared_layers

    shared = kv_shared_layers(c)
    uniform = (dims["kv_heads"] * dims["head_dim"], dims["kv_heads"] * dims["v_head_dim"])
    kv = tuple((0, 0) if i in shared else meta.kv_widths.get(i, uniform) for i in range(c.num_hidden_layers))
    return () if all(w == uniform for w in kv) else kv


class _GenericMlps(TypedDict):
    mlps: tuple[str, ...]
    intermediate: int
    moe_intermediate: int
    experts_per_token: int
    num_experts: int
    shared_intermediate: int


def _generic_mlps(c, meta: _MetaModel) -> _GenericMlps:
    """Dense or routed-expert MLP per layer (a layer holding `.experts.` parameters in the meta model is MoE), the
    dense width (`_DENSE_WIDTHS`, else 4 x hidden) and the experts' count, top-k and widths under the names
    the families use."""
    n = c.num_hidden_layers
    dense = _first(c, _DENSE_WIDTHS) or 4 * c.hidden_size
    moe = _first(c, _EXPERT_WIDTHS) or dense
    shared = _first(c, _SHARED_EXPERT_WIDTHS) or _first(c, _SHARED_EXPERT_COUNTS) * moe
    return {"mlps": tuple("moe" if i in meta.moe_layers else "dense" for i in range(n)), "intermediate": dense,
            "moe_intermediate": moe if meta.moe_layers else 0,
            "experts_per_token": _first(c, _EXPERTS_PER_TOKEN) if meta.moe_layers else 0,
            "num_experts": _first(c, _EXPERT_COUNTS) if meta.moe_layers else 0,
            "shared_intermediate": shared if meta.moe_layers else 0}


class _MlaLatentDims(TypedDict):
    heads: int
    kv_heads: int
    head_dim: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_dim: int
    qk_nope_dim: int
    v_head_dim: int


def _mla_latent_dims(c) -> _MlaLatentDims:
    """Latent attention (MLA) dimensions, without the MLP widths (`_generic_mlps` reads those)."""
    return {
        "heads": c.num_attention_heads, "kv_heads": c.num_attention_heads,
        "head_dim": c.qk_nope_head_dim + c.qk_rope_head_dim, "q_lora_rank": c.q_lora_rank or 0,
        "kv_lora_rank": c.kv_lora_rank, "qk_rope_dim": c.qk_rope_head_dim, "qk_nope_dim": c.qk_nope_head_dim,
        "v_head_dim": c.v_head_dim,
    }


# Every model type `spec_from_config` describes.
PLANNER_TYPES = (PLANNER_MODEL_TYPES + ATTENTION_MODEL_TYPES + MLA_MODEL_TYPES + DSA_MODEL_TYPES + MAMBA2_HYBRID_TYPES
                 + GATED_DELTANET_TYPES + SHORT_CONV_TYPES + LIGHTNING_TYPES + SHARED_BLOCK_TYPES + CCA_TYPES)


# Sizes a model cannot have fewer than one of, besides its head counts: transformers' config, the model's layers and
# the planner's per-layer and per-head arithmetic divide by them or build empty tensors from them.
_POSITIVE_SIZES = ("head_dim", "hidden_size", "num_hidden_layers")


def check_head_counts(values: dict[str, Any], where: str) -> None:
    """Refuse a head count below 1 (`num_attention_heads`, `num_key_value_heads`, `linear_num_value_heads`, ..., in
    a nested text config too), or a `head_dim`, `hidden_size` or `num_hidden_layers` below 1, before transformers'
    config or model or the planner divides by it, which is a ZeroDivisionError or ValueError traceback; None stays
    allowed (transformers' "same as the heads", or a size derived from the others)."""
    for key, value in sorted(values.items()):
        if isinstance(value, dict):
            check_head_counts(value, where)
        elif not isinstance(key, str) or not isinstance(value, int) or isinstance(value, bool) or value >= 1:
            continue
        elif key.endswith("heads"):
            raise ValueError(f"{where}: {key} = {value}; a model needs at least one head (the head size and the "
                             "grouping of query heads per key/value head divide by it): fix the config")
        elif key in _POSITIVE_SIZES:
            raise ValueError(f"{where}: {key} = {value}; a model needs {key} >= 1 (its layers and their sizes are "
                             "built from it): fix the config")


def spec_from_config(config, name: str = "") -> ModelSpec:
    """Read layer kinds and dimensions from a transformers config (text config of a multimodal wrapper)."""
    c = getattr(config, "text_config", None) or config
    check_head_counts(c.to_dict(), name or c.model_type)
    mt = c.model_type
    n = c.num_hidden_layers
    meta = _meta_model(c)
    base: dict[str, Any] = {  # ModelSpec's common fields, read from the (untyped) config
        "name": name or mt, "model_type": mt, "hidden": c.hidden_size, "vocab": c.vocab_size,
        "params": meta.total, "expert_params": meta.expert, "max_layer_params": meta.max_layer,
        "tied": bool(getattr(c, "tie_word_embeddings", False)), "eager_attention": meta.eager_attention,
        "max_positions": int(getattr(c, "max_position_embeddings", 0) or 0),
    }
    layer_types = list(getattr(c, "layer_types", None) or [])
    if mt in ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "cohere2"):
        # Cohere2: sliding layers and global layers without RoPE (same state), attention and MLP in parallel behind
        # one LayerNorm (counted as two norms: a small overestimate)
        window = getattr(c, "sliding_window", None) or 0
        if not layer_types:
            uses = getattr(c, "use_sliding_window", True) and window
            layer_types = ["sliding_attention" if uses else "full_attention"] * n
        mixers = tuple("sliding" if t == "sliding_attention" else "attention" for t in layer_types)
        return ModelSpec(
            **base, mixers=mixers, mlps=("dense",) * n, **_attention_dims(c),
            qk_norm=mt in ("qwen3", "gemma3_text"), window=window, intermediate=c.intermediate_size,
        )
    elif mt in ("qwen3_next", "qwen3_5_text"):
        mixers = tuple("linear" if t == "linear_attention" else "attention" for t in layer_types)
        if mt == "qwen3_next":
            mlps = tuple("dense" if i in (c.mlp_only_layers or []) or c.num_experts == 0
                         or (i + 1) % c.decoder_sparse_step else "moe" for i in range(n))
            moe = {"moe_intermediate": c.moe_intermediate_size, "experts_per_token": c.num_experts_per_tok,
                   "num_experts": c.num_experts, "shared_intermediate": c.shared_expert_intermediate_size}
        else:
            mlps, moe = ("dense",) * n, {}
        return ModelSpec(
            **base, mixers=mixers, mlps=mlps, **_attention_dims(c), qk_norm=True, attn_gate=True,
            intermediate=c.intermediate_size, lin_key_heads=c.linear_num_key_heads,
            lin_value_heads=c.linear_num_value_heads, lin_key_dim=c.linear_key_head_dim,
            lin_value_dim=c.linear_value_head_dim, conv_kernel=c.linear_conv_kernel_dim, **moe,
        )
    elif mt == "glm4_moe":  # GQA (partial rotary, optional q/k norm) with DeepSeek-style MoE FFNs
        return ModelSpec(
            **base, mixers=("attention",) * n, mlps=_moe_layers(c, n), **_attention_dims(c), qk_norm=c.use_qk_norm,
            intermediate=c.intermediate_size, moe_intermediate=c.moe_intermediate_size,
            experts_per_token=c.num_experts_per_tok, num_experts=c.n_routed_experts,
            shared_intermediate=(c.n_shared_experts or 0) * c.moe_intermediate_size,
        )
    elif mt == "gpt_oss":  # sliding and full GQA layers (their sinks: one scalar per head, no per-token state), MoE
        mixers = tuple("sliding" if t == "sliding_attention" else "attention" for t in layer_types)
        return ModelSpec(
            **base, mixers=mixers, mlps=("moe",) * n, **_attention_dims(c), window=c.sliding_window or 0,
            intermediate=c.intermediate_size, moe_intermediate=c.intermediate_size,
            experts_per_token=c.num_experts_per_tok, num_experts=c.num_local_experts,
        )
    elif mt == "nemotron_h":  # each block one of: Mamba2 mixer, attention (no RoPE), MLP, MoE
        mixers, mlps = _nemotron_h_blocks(c.layers_block_type)
        return ModelSpec(
            **base, mixers=mixers, mlps=mlps, **_attention_dims(c), intermediate=c.intermediate_size,
            moe_intermediate=c.moe_intermediate_size, experts_per_token=c.num_experts_per_tok,
            num_experts=c.n_routed_experts, shared_intermediate=c.moe_shared_expert_intermediate_size,
            mamba_heads=c.mamba_num_heads, mamba_head_dim=c.mamba_head_dim, mamba_state=c.ssm_state_size,
            mamba_groups=c.n_groups, conv_kernel=c.conv_kernel, mamba_chunk=c.chunk_size or MAMBA_SCAN_CHUNK,
        )
    elif mt == "mamba2":
        return ModelSpec(
            **base, mixers=("mamba",) * n, mlps=("none",) * n, mamba_heads=c.num_heads,
            mamba_head_dim=c.head_dim, mamba_state=c.state_size, mamba_groups=c.n_groups,
            conv_kernel=c.conv_kernel, mamba_chunk=c.chunk_size or MAMBA_SCAN_CHUNK,
        )
    elif mt in ("mamba", "falcon_mamba"):  # Mamba-1 blocks: one mixer each, no MLP
        return ModelSpec(
            **base, mixers=("mamba1",) * n, mlps=("none",) * n, mamba_heads=c.intermediate_size, mamba_head_dim=1,
            mamba_state=c.state_size, conv_kernel=c.conv_kernel,
        )
    elif mt == "jamba":  # Mamba-1 or attention layers, each with a dense MLP or an MoE
        return ModelSpec(
            **base, mixers=tuple("mamba1" if k == "mamba" else "attention" for k in c.layers_block_type),
            mlps=tuple("moe" if e > 1 else "dense" for e in c.layers_num_experts), **_attention_dims(c),
            intermediate=c.intermediate_size, moe_intermediate=c.intermediate_size,
            experts_per_token=c.num_experts_per_tok, num_experts=c.num_experts,
            mamba_heads=c.mamba_expand * c.hidden_size, mamba_head_dim=1, mamba_state=c.mamba_d_state,
            conv_kernel=c.mamba_d_conv,
        )
    elif mt == "falcon_h1":
        heads = c.mamba_n_heads
        head_dim = c.mamba_d_head if c.mamba_d_head != "auto" else c.mamba_expand * c.hidden_size // heads
        return ModelSpec(
            **base, mixers=("attention+mamba",) * n, mlps=("dense",) * n, **_attention_dims(c),
            intermediate=c.intermediate_size, mamba_heads=heads, mamba_head_dim=head_dim,
            mamba_state=c.mamba_d_state, mamba_groups=c.mamba_n_groups, conv_kernel=c.mamba_d_conv,
            mamba_chunk=getattr(c, "mamba_chunk_size", None) or MAMBA_SCAN_CHUNK,
        )
    elif mt == "kimi_linear":  # KDA layers (linear attention, one head set) + MLA layers, MoE FFNs
        mixers = tuple("linear" if t == "linear_attention" else "mla" for t in layer_types)
        return ModelSpec(
            **base, mixers=mixers, mlps=_moe_layers(c, n), **_mla_dims(c),
            experts_per_token=c.num_experts_per_token, num_experts=c.num_experts,
            shared_intermediate=(c.num_shared_experts or 0) * c.moe_intermediate_size, lin_key_heads=c.linear_num_heads,
            lin_value_heads=c.linear_num_heads, lin_key_dim=c.linear_head_dim, lin_value_dim=c.linear_head_dim,
            conv_kernel=c.linear_conv_kernel_dim,
        )
    elif mt in ("deepseek_v3", "glm_moe_dsa"):
        if mt == "glm_moe_dsa":
            types = list(getattr(c, "indexer_types", None) or ["full"] * n)
            mixers = tuple("dsa" if t != "shared" else "mla" for t in types)
            index_layers = tuple(t != "shared" for t in types)
            index = {"index_heads": c.index_n_heads, "index_dim": c.index_head_dim}
        else:
            mixers, index_layers, index = ("mla",) * n, (), {}
        return ModelSpec(
            **base, mixers=mixers, mlps=_moe_layers(c, n), **_mla_dims(c),
            experts_per_token=c.num_experts_per_tok, num_experts=c.n_routed_experts,
            shared_intermediate=(c.n_shared_experts or 0) * c.moe_intermediate_size, index_layers=index_layers,
            **index,
        )
    elif mt in ATTENTION_MODEL_TYPES:
        mixers, window = _layer_mixers(c, mt)
        # a heterogeneous config (transformers' `per_layer_config`: Gemma-4) refuses to read per-layer fields
        # globally: its first layer's stand for every layer, and `layer_kv` holds each layer's own K/V widths
        dims = _generic_attention_dims(c.per_layer_config[0] if getattr(c, "is_heterogeneous", False) else c)
        return ModelSpec(**base, mixers=mixers, **dims, qk_norm=meta.qk_norm, window=window,
                         **_generic_mlps(c, meta), layer_kv=_layer_kv(c, dims, meta))
    elif mt in MLA_MODEL_TYPES or mt in DSA_MODEL_TYPES:
        if mt in DSA_MODEL_TYPES:
            types = list(getattr(c, "indexer_types", None) or ["full"] * n)
            index_layers = tuple(t != "shared" for t in types)
            mixers = tuple("dsa" if keeps else "mla" for keeps in index_layers)
            index = {"index_heads": c.index_n_heads, "index_dim": c.index_head_dim}
        else:
            mixers, index_layers, index = ("mla",) * n, (), {}
        return ModelSpec(**base, mixers=mixers, index_layers=index_layers, **index, **_mla_latent_dims(c),
                         **_generic_mlps(c, meta))
    elif mt in MAMBA2_HYBRID_TYPES:
        mixers, window = _layer_mixers(c, mt, linear="mamba")
        heads = c.mamba_n_heads
        head_dim = c.mamba_d_head if c.mamba_d_head != "auto" else c.mamba_expand * c.hidden_size // heads
        return ModelSpec(
            **base, mixers=mixers, **_attention_dims(c), window=window, **_generic_mlps(c, meta),
            mamba_heads=heads, mamba_head_dim=head_dim, mamba_state=c.mamba_d_state, mamba_groups=c.mamba_n_groups,
            conv_kernel=c.mamba_d_conv, mamba_chunk=getattr(c, "mamba_chunk_size", None) or MAMBA_SCAN_CHUNK,
        )
    elif mt in GATED_DELTANET_TYPES:
        mixers, window = _layer_mixers(c, mt, linear="linear")
        return ModelSpec(
            **base, mixers=mixers, **_attention_dims(c), qk_norm=meta.qk_norm, window=window,
            **_generic_mlps(c, meta), lin_key_heads=c.linear_num_key_heads, lin_value_heads=c.linear_num_value_heads,
            lin_key_dim=c.linear_key_head_dim, lin_value_dim=c.linear_value_head_dim,
            conv_kernel=c.linear_conv_kernel_dim,
        )
    elif mt in SHORT_CONV_TYPES:
        mixers, window = _layer_mixers(c, mt)
        return ModelSpec(**base, mixers=mixers, **_attention_dims(c), qk_norm=meta.qk_norm, window=window,
                         **_generic_mlps(c, meta), conv_kernel=c.conv_L_cache)
    elif mt in LIGHTNING_TYPES:  # lightning attention: heads x head_dim x head_dim per layer, the model's dtype
        mixers, window = _layer_mixers(c, mt, linear="lightning")
        heads = _attention_dims(c)
        return ModelSpec(
            **base, mixers=mixers, **heads, qk_norm=meta.qk_norm, window=window, **_generic_mlps(c, meta),
            lin_key_heads=heads["heads"], lin_value_heads=heads["heads"], lin_key_dim=heads["head_dim"],
            lin_value_dim=heads["head_dim"],
        )
    elif mt in SHARED_BLOCK_TYPES:  # Mamba2 layers; hybrid layers: Mamba2 + a shared attention block and its MLP
        blocks: list[tuple[str, str]] = []  # (mixer, mlp) per layer
        for kind in c.layers_block_type:
            if kind in ("linear_attention", "mamba"):
                blocks.append(("mamba", "none"))
            elif kind == "hybrid":
                blocks.append(("attention+mamba", "dense"))
            else:
                raise ValueError(f"{mt}: the planner does not model block type {kind!r} (it models linear_attention "
                                 "(Mamba2) and hybrid)")
        return ModelSpec(
            **base, mixers=tuple(k[0] for k in blocks), mlps=tuple(k[1] for k in blocks), heads=c.num_attention_heads,
            kv_heads=c.num_key_value_heads or c.num_attention_heads, head_dim=c.attention_head_dim,
            intermediate=c.intermediate_size, mamba_heads=c.n_mamba_heads, mamba_head_dim=c.mamba_headdim,
            mamba_state=c.mamba_d_state, mamba_groups=c.mamba_ngroups, conv_kernel=c.mamba_d_conv,
            mamba_chunk=c.chunk_size or MAMBA_SCAN_CHUNK,
        )
    elif mt in CCA_TYPES:  # K/V, a window of the q/k convolution's inputs and the last token's delayed value
        kinds = sorted({str(t) for t in layer_types} - {"hybrid"})
        if kinds:
            raise ValueError(f"{mt}: the planner does not model layer type {kinds[0]!r} of this family (it models "
                             "hybrid: compressed convolutional attention without a window)")
        return ModelSpec(
            **base, mixers=("cca",) * n, **_attention_dims(c), qk_norm=True, **_generic_mlps(c, meta),
            conv_kernel=(c.cca_time0 - 1) + (c.cca_time1 - 1),
        )
    else:
        kinds = sorted({str(t) for t in layer_types})
        raise ValueError(
            f"the planner has no formulas for model_type {mt!r}"
            + (f" (its layer types: {', '.join(kinds)})" if kinds else "") + ": it models full, sliding and chunked "
            "attention, MLA, DSA, gated DeltaNet, KDA, lightning attention, Mamba2, Mamba-1, short-convolution and "
            "compressed convolutional attention layers, in the "
            f"{len(PLANNER_TYPES)} model types listed in longstraw.planner.spec (PLANNER_TYPES), each checked "
            "against its captured prompt state"
        )
