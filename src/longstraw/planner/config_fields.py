"""The fields of a transformers config the planner's family readers (`families`) share: the model types each reader
covers (`ATTENTION_MODEL_TYPES`, `MLA_MODEL_TYPES`, ...), the attribute names a dimension goes by across families,
and the helpers reading attention, MLA, MoE and per-layer mixer dimensions."""

from __future__ import annotations

from typing import Any

from longstraw.models.sources import is_int
from longstraw.planner.spec import MAMBA_SCAN_CHUNK, _MetaModel

# `ModelSpec` keyword arguments read from a config (whose values are untyped).
Fields = dict[str, Any]


def _attention_dims(c) -> Fields:
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


def _mla_dims(c) -> Fields:
    """Latent attention (MLA) dimensions and the dense/expert MLP widths, which Kimi-Linear, DeepSeek-V3 and GLM-DSA
    configs spell alike (their expert counts are spelled differently)."""
    return {**_mla_latent_dims(c), "intermediate": c.intermediate_size, "moe_intermediate": c.moe_intermediate_size}


def _mla_mixers(c, n: int, dsa: bool) -> Fields:
    """`mixers` of MLA layers; with DSA (`dsa`) the layers whose `indexer_types` entry is not "shared" (every layer
    without it) keep their own indexer keys: `dsa` mixers, `index_layers` and the indexer's dims."""
    if not dsa:
        return {"mixers": ("mla",) * n}
    keeps = tuple(t != "shared" for t in list(getattr(c, "indexer_types", None) or ["full"] * n))
    return {"mixers": tuple("dsa" if k else "mla" for k in keeps), "index_layers": keeps,
            "index_heads": c.index_n_heads, "index_dim": c.index_head_dim}


def _deltanet_dims(c) -> Fields:
    """Gated-DeltaNet dimensions under Qwen3-Next's field names."""
    return {"lin_key_heads": c.linear_num_key_heads, "lin_value_heads": c.linear_num_value_heads,
            "lin_key_dim": c.linear_key_head_dim, "lin_value_dim": c.linear_value_head_dim,
            "conv_kernel": c.linear_conv_kernel_dim}


def _falcon_mamba_dims(c) -> Fields:
    """Mamba2 dimensions under Falcon-H1's field names (`mamba_d_head` "auto": expand x hidden / heads)."""
    heads = c.mamba_n_heads
    head_dim = c.mamba_d_head if c.mamba_d_head != "auto" else c.mamba_expand * c.hidden_size // heads
    return {"mamba_heads": heads, "mamba_head_dim": head_dim, "mamba_state": c.mamba_d_state,
            "mamba_groups": c.mamba_n_groups, "conv_kernel": c.mamba_d_conv,
            "mamba_chunk": getattr(c, "mamba_chunk_size", None) or MAMBA_SCAN_CHUNK}


# Nemotron-H's blocks, each one token mixer or one MLP (`layers_block_type`): (mixer, mlp) per block type
# (`linear_attention`: transformers' name for its Mamba2 blocks).
NEMOTRON_H_BLOCKS = {"linear_attention": ("mamba", "none"), "full_attention": ("attention", "none"),
                     "mlp": ("none", "dense"), "moe": ("none", "moe")}


def _blocks(kinds: list[str], table: dict[str, tuple[str, str]], refusal: str) -> tuple[tuple[str, ...], ...]:
    """(mixers, mlps) of a family whose config names each layer's block type (`table`: its (mixer, mlp));
    ValueError `refusal` (formatted with `kind`) for a type not in `table`."""
    for kind in kinds:
        if kind not in table:
            raise ValueError(refusal.format(kind=kind))
    return tuple(table[k][0] for k in kinds), tuple(table[k][1] for k in kinds)


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
    "nanochat", "nemotron", "olmo", "olmo2", "olmo3", "olmoe", "persimmon", "phi", "phi3", "phimoe", "qwen2_moe",
    "qwen3_moe", "sarvam_moe", "seed_oss", "smollm3", "solar_open", "stablelm", "starcoder2", "vaultgemma",
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
# LFM2's gated short convolutions (`conv` layers: a (hidden, conv_L_cache) window, no recurrent state) + attention.
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
        if is_int(value) and value > 0:
            return value
    return 0


def _layer_mixers(c, mt: str, linear: str = "") -> tuple[tuple[str, ...], int]:
    """(mixer per layer, sliding window) from `layer_types` (`full_attention`, `sliding_attention`; `linear_attention`
    as `linear`; `conv` for the short-convolution families), else all full attention, or sliding where the config sets
    `sliding_window` not turned off by `use_sliding_window`. ValueError for a layer type the planner does not model."""
    n = c.num_hidden_layers
    window = 0 if mt in WINDOW_UNUSED_TYPES else getattr(c, "sliding_window", None) or 0
    types = list(getattr(c, "layer_types", None) or [])
    if not types:
        sliding = window and getattr(c, "use_sliding_window", True) is not False
        return ("sliding" if sliding else "attention",) * n, window
    kinds = {"full_attention": "attention", "attention": "attention", "chunked_attention": "chunked",
             "sliding_attention": "sliding" if window else "", "linear_attention": linear,
             "conv": "conv" if mt in SHORT_CONV_TYPES else ""}
    for t in types:
        if not kinds.get(t):
            raise ValueError(f"{mt}: the planner does not model layer type {t!r} of this family (it models "
                             "full_attention, sliding_attention with a sliding_window, chunked_attention"
                             + (f", linear_attention as {linear}" if linear else "")
                             + (", conv" if mt in SHORT_CONV_TYPES else "") + ")")
    return tuple(kinds[t] for t in types), window


def _generic_attention_dims(c) -> Fields:
    """Query heads, K/V heads (one for multi-query configs), the head dim (`head_dim`, else `kv_channels`, else
    hidden / heads) and the V head dim where the config gives a different one."""
    heads = c.num_attention_heads
    kv = 1 if getattr(c, "multi_query", False) else getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or getattr(c, "kv_channels", None) or c.hidden_size // heads
    return {"heads": heads, "kv_heads": kv, "head_dim": head_dim,
            "v_head_dim": getattr(c, "v_head_dim", None) or head_dim}


def _layer_kv(c, dims: Fields, meta: _MetaModel) -> tuple[tuple[int, int], ...]:
    """`ModelSpec.layer_kv`: each layer's (key, value) widths from its attention's projections (`kv_widths`), none for
    the layers that reuse an earlier layer's K/V (Gemma-4's `num_kv_shared_layers`), the config's dims for layers
    without a `k_proj`; empty where every layer keeps the config's kv_heads x (head_dim + v_head_dim)."""
    from longstraw.engine.state.sharing import kv_shared_layers

    shared = kv_shared_layers(c)
    uniform = (dims["kv_heads"] * dims["head_dim"], dims["kv_heads"] * dims["v_head_dim"])
    kv = tuple((0, 0) if i in shared else meta.kv_widths.get(i, uniform) for i in range(c.num_hidden_layers))
    return () if all(w == uniform for w in kv) else kv


def _generic_mlps(c, meta: _MetaModel) -> Fields:
    """Dense or routed-expert MLP per layer (a layer holding `.experts.` parameters in the meta model is MoE), the dense
    width (`_DENSE_WIDTHS`, else 4 x hidden) and the experts' count, top-k and widths, as the families name them."""
    n = c.num_hidden_layers
    dense = _first(c, _DENSE_WIDTHS) or 4 * c.hidden_size
    moe = _first(c, _EXPERT_WIDTHS) or dense
    shared = _first(c, _SHARED_EXPERT_WIDTHS) or _first(c, _SHARED_EXPERT_COUNTS) * moe
    return {"mlps": tuple("moe" if i in meta.moe_layers else "dense" for i in range(n)), "intermediate": dense,
            "moe_intermediate": moe if meta.moe_layers else 0,
            "experts_per_token": _first(c, _EXPERTS_PER_TOKEN) if meta.moe_layers else 0,
            "num_experts": _first(c, _EXPERT_COUNTS) if meta.moe_layers else 0,
            "shared_intermediate": shared if meta.moe_layers else 0}


def _mla_latent_dims(c) -> Fields:
    """Latent attention (MLA) dimensions, without the MLP widths (`_generic_mlps` reads those)."""
    return {
        "heads": c.num_attention_heads, "kv_heads": c.num_attention_heads,
        "head_dim": c.qk_nope_head_dim + c.qk_rope_head_dim, "q_lora_rank": c.q_lora_rank or 0,
        "kv_lora_rank": c.kv_lora_rank, "qk_rope_dim": c.qk_rope_head_dim, "qk_nope_dim": c.qk_nope_head_dim,
        "v_head_dim": c.v_head_dim,
    }
