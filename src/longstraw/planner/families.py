"""The planner's readers of transformers configs, one per model family: `spec_from_config` (a `ModelSpec` from a
config), and `PLANNER_TYPES`: every model type they read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from longstraw.models.sources import check_head_counts
from longstraw.planner.config_fields import (
    ATTENTION_MODEL_TYPES,
    CCA_TYPES,
    DSA_MODEL_TYPES,
    GATED_DELTANET_TYPES,
    LIGHTNING_TYPES,
    MAMBA2_HYBRID_TYPES,
    MLA_MODEL_TYPES,
    NEMOTRON_H_BLOCKS,
    SHARED_BLOCK_TYPES,
    SHORT_CONV_TYPES,
    Fields,
    _attention_dims,
    _blocks,
    _deltanet_dims,
    _falcon_mamba_dims,
    _generic_attention_dims,
    _generic_mlps,
    _layer_kv,
    _layer_mixers,
    _mla_dims,
    _mla_latent_dims,
    _mla_mixers,
    _moe_layers,
)
from longstraw.planner.spec import MAMBA_SCAN_CHUNK, ModelSpec, _meta_model, _MetaModel

# Every reader takes (config, model type, layers, meta-device counts, ModelSpec's common fields, `layer_types`).


def _read_plain_attention(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    # Cohere2: sliding layers and global layers without RoPE (same state), attention and MLP in parallel behind
    # one LayerNorm (counted as two norms: a small overestimate)
    window = getattr(c, "sliding_window", None) or 0
    if not types:
        uses = getattr(c, "use_sliding_window", True) and window
        types = ["sliding_attention" if uses else "full_attention"] * n
    mixers = tuple("sliding" if t == "sliding_attention" else "attention" for t in types)
    return ModelSpec(
        **base, mixers=mixers, mlps=("dense",) * n, **_attention_dims(c),
        qk_norm=mt in ("qwen3", "gemma3_text"), window=window, intermediate=c.intermediate_size,
    )


def _read_qwen3_next(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    mixers = tuple("linear" if t == "linear_attention" else "attention" for t in types)
    if mt == "qwen3_next":
        mlps = tuple("dense" if i in (c.mlp_only_layers or []) or c.num_experts == 0
                     or (i + 1) % c.decoder_sparse_step else "moe" for i in range(n))
        moe = {"moe_intermediate": c.moe_intermediate_size, "experts_per_token": c.num_experts_per_tok,
               "num_experts": c.num_experts, "shared_intermediate": c.shared_expert_intermediate_size}
    else:
        mlps, moe = ("dense",) * n, {}
    return ModelSpec(**base, mixers=mixers, mlps=mlps, **_attention_dims(c), qk_norm=True, attn_gate=True,
                     intermediate=c.intermediate_size, **_deltanet_dims(c), **moe)


def _read_glm4_moe(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    """GQA (partial rotary, optional q/k norm) with DeepSeek-style MoE FFNs"""
    return ModelSpec(
        **base, mixers=("attention",) * n, mlps=_moe_layers(c, n), **_attention_dims(c), qk_norm=c.use_qk_norm,
        intermediate=c.intermediate_size, moe_intermediate=c.moe_intermediate_size,
        experts_per_token=c.num_experts_per_tok, num_experts=c.n_routed_experts,
        shared_intermediate=(c.n_shared_experts or 0) * c.moe_intermediate_size,
    )


def _read_gpt_oss(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    """Sliding and full GQA layers (their sinks: one scalar per head, no per-token state), MoE"""
    mixers = tuple("sliding" if t == "sliding_attention" else "attention" for t in types)
    return ModelSpec(
        **base, mixers=mixers, mlps=("moe",) * n, **_attention_dims(c), window=c.sliding_window or 0,
        intermediate=c.intermediate_size, moe_intermediate=c.intermediate_size,
        experts_per_token=c.num_experts_per_tok, num_experts=c.num_local_experts,
    )


def _read_nemotron_h(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    """Each block one of: Mamba2 mixer, attention (no RoPE), MLP, MoE"""
    mixers, mlps = _blocks(c.layers_block_type, NEMOTRON_H_BLOCKS, "unknown Nemotron-H block type {kind!r} (known: "
                                                                    "linear_attention, full_attention, mlp, moe)")
    return ModelSpec(
        **base, mixers=mixers, mlps=mlps, **_attention_dims(c), intermediate=c.intermediate_size,
        moe_intermediate=c.moe_intermediate_size, experts_per_token=c.num_experts_per_tok,
        num_experts=c.n_routed_experts, shared_intermediate=c.moe_shared_expert_intermediate_size,
        mamba_heads=c.mamba_num_heads, mamba_head_dim=c.mamba_head_dim, mamba_state=c.ssm_state_size,
        mamba_groups=c.n_groups, conv_kernel=c.conv_kernel, mamba_chunk=c.chunk_size or MAMBA_SCAN_CHUNK,
    )


def _read_mamba2(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    return ModelSpec(
        **base, mixers=("mamba",) * n, mlps=("none",) * n, mamba_heads=c.num_heads,
        mamba_head_dim=c.head_dim, mamba_state=c.state_size, mamba_groups=c.n_groups,
        conv_kernel=c.conv_kernel, mamba_chunk=c.chunk_size or MAMBA_SCAN_CHUNK,
    )


def _read_mamba1(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    """Mamba-1 blocks: one mixer each, no MLP"""
    return ModelSpec(
        **base, mixers=("mamba1",) * n, mlps=("none",) * n, mamba_heads=c.intermediate_size, mamba_head_dim=1,
        mamba_state=c.state_size, conv_kernel=c.conv_kernel,
    )


def _read_jamba(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    """Mamba-1 or attention layers, each with a dense MLP or an MoE"""
    return ModelSpec(
        **base, mixers=tuple("mamba1" if k == "mamba" else "attention" for k in c.layers_block_type),
        mlps=tuple("moe" if e > 1 else "dense" for e in c.layers_num_experts), **_attention_dims(c),
        intermediate=c.intermediate_size, moe_intermediate=c.intermediate_size,
        experts_per_token=c.num_experts_per_tok, num_experts=c.num_experts,
        mamba_heads=c.mamba_expand * c.hidden_size, mamba_head_dim=1, mamba_state=c.mamba_d_state,
        conv_kernel=c.mamba_d_conv,
    )


def _read_falcon_h1(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    return ModelSpec(**base, mixers=("attention+mamba",) * n, mlps=("dense",) * n, **_attention_dims(c),
                     intermediate=c.intermediate_size, **_falcon_mamba_dims(c))


def _read_kimi_linear(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    """KDA layers (linear attention, one head set) + MLA layers, MoE FFNs"""
    mixers = tuple("linear" if t == "linear_attention" else "mla" for t in types)
    return ModelSpec(
        **base, mixers=mixers, mlps=_moe_layers(c, n), **_mla_dims(c),
        experts_per_token=c.num_experts_per_token, num_experts=c.num_experts,
        shared_intermediate=(c.num_shared_experts or 0) * c.moe_intermediate_size, lin_key_heads=c.linear_num_heads,
        lin_value_heads=c.linear_num_heads, lin_key_dim=c.linear_head_dim, lin_value_dim=c.linear_head_dim,
        conv_kernel=c.linear_conv_kernel_dim,
    )


def _read_deepseek_v3(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    return ModelSpec(
        **base, **_mla_mixers(c, n, dsa=mt == "glm_moe_dsa"), mlps=_moe_layers(c, n), **_mla_dims(c),
        experts_per_token=c.num_experts_per_tok, num_experts=c.n_routed_experts,
        shared_intermediate=(c.n_shared_experts or 0) * c.moe_intermediate_size,
    )


def _read_generic_attention(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    mixers, window = _layer_mixers(c, mt)
    # a heterogeneous config (transformers' `per_layer_config`: Gemma-4) refuses to read per-layer fields
    # globally: its first layer's stand for every layer, and `layer_kv` holds each layer's own K/V widths
    dims = _generic_attention_dims(c.per_layer_config[0] if getattr(c, "is_heterogeneous", False) else c)
    return ModelSpec(**base, mixers=mixers, **dims, qk_norm=meta.qk_norm, window=window,
                     **_generic_mlps(c, meta), layer_kv=_layer_kv(c, dims, meta))


def _read_generic_mla(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    return ModelSpec(**base, **_mla_mixers(c, n, dsa=mt in DSA_MODEL_TYPES), **_mla_latent_dims(c),
                     **_generic_mlps(c, meta))


def _hybrid(linear: str, extra: Callable[[Any], Fields], qk_norm: bool = True) -> Callable[..., ModelSpec]:
    """The reader of a family of attention layers beside `linear` layers (`_layer_mixers`), generic MLPs, and the
    linear layers' dimensions `extra(config)`; q/k norms as the meta model has them (`qk_norm`)."""

    def read(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
        mixers, window = _layer_mixers(c, mt, linear=linear)
        return ModelSpec(**base, mixers=mixers, **_attention_dims(c), qk_norm=qk_norm and meta.qk_norm, window=window,
                         **_generic_mlps(c, meta), **extra(c))
    return read


def _lightning_dims(c: Any) -> Fields:
    """Lightning attention: heads x head_dim x head_dim per layer, the model's dtype"""
    heads = _attention_dims(c)
    return {"lin_key_heads": heads["heads"], "lin_value_heads": heads["heads"], "lin_key_dim": heads["head_dim"],
            "lin_value_dim": heads["head_dim"]}


def _read_shared_block(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    """Mamba2 layers; hybrid layers: Mamba2 + a shared attention block and its MLP"""
    table = {"linear_attention": ("mamba", "none"), "mamba": ("mamba", "none"), "hybrid": ("attention+mamba", "dense")}
    mixers, mlps = _blocks(c.layers_block_type, table, f"{mt}: the planner does not model block type "
                                                       "{kind!r} (it models linear_attention (Mamba2) and hybrid)")
    return ModelSpec(
        **base, mixers=mixers, mlps=mlps, heads=c.num_attention_heads,
        kv_heads=c.num_key_value_heads or c.num_attention_heads, head_dim=c.attention_head_dim,
        intermediate=c.intermediate_size, mamba_heads=c.n_mamba_heads, mamba_head_dim=c.mamba_headdim,
        mamba_state=c.mamba_d_state, mamba_groups=c.mamba_ngroups, conv_kernel=c.mamba_d_conv,
        mamba_chunk=c.chunk_size or MAMBA_SCAN_CHUNK,
    )


def _read_cca(c: Any, mt: str, n: int, meta: _MetaModel, base: Fields, types: list[str]) -> ModelSpec:
    """K/V, a window of the q/k convolution's inputs and the last token's delayed value"""
    kinds = sorted({str(t) for t in types} - {"hybrid"})
    if kinds:
        raise ValueError(f"{mt}: the planner does not model layer type {kinds[0]!r} of this family (it models "
                         "hybrid: compressed convolutional attention without a window)")
    return ModelSpec(
        **base, mixers=("cca",) * n, **_attention_dims(c), qk_norm=True, **_generic_mlps(c, meta),
        conv_kernel=(c.cca_time0 - 1) + (c.cca_time1 - 1),
    )


# model type -> its reader; the families read generically come first, so a type with a reader of its own keeps it
_READERS: dict[str, Callable[..., ModelSpec]] = {
    **dict.fromkeys(ATTENTION_MODEL_TYPES, _read_generic_attention),
    **dict.fromkeys(MLA_MODEL_TYPES + DSA_MODEL_TYPES, _read_generic_mla),
    **dict.fromkeys(MAMBA2_HYBRID_TYPES, _hybrid("mamba", _falcon_mamba_dims, qk_norm=False)),
    **dict.fromkeys(GATED_DELTANET_TYPES, _hybrid("linear", _deltanet_dims)),
    **dict.fromkeys(SHORT_CONV_TYPES, _hybrid("", lambda c: {"conv_kernel": c.conv_L_cache})),
    **dict.fromkeys(LIGHTNING_TYPES, _hybrid("lightning", _lightning_dims)),
    **dict.fromkeys(SHARED_BLOCK_TYPES, _read_shared_block),
    **dict.fromkeys(CCA_TYPES, _read_cca),
    **dict.fromkeys(("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "cohere2"), _read_plain_attention),
    "qwen3_next": _read_qwen3_next, "qwen3_5_text": _read_qwen3_next, "glm4_moe": _read_glm4_moe,
    "gpt_oss": _read_gpt_oss, "nemotron_h": _read_nemotron_h, "mamba2": _read_mamba2, "mamba": _read_mamba1,
    "falcon_mamba": _read_mamba1, "jamba": _read_jamba, "falcon_h1": _read_falcon_h1,
    "kimi_linear": _read_kimi_linear, "deepseek_v3": _read_deepseek_v3, "glm_moe_dsa": _read_deepseek_v3,
}
PLANNER_TYPES = tuple(_READERS)


def spec_from_config(config, name: str = "") -> ModelSpec:
    """Read layer kinds and dimensions from a transformers config (text config of a multimodal wrapper)."""
    c = getattr(config, "text_config", None) or config
    check_head_counts(c.to_dict(), name or c.model_type)
    mt = c.model_type
    n = c.num_hidden_layers
    meta = _meta_model(c)
    base: Fields = {  # ModelSpec's common fields, read from the (untyped) config
        "name": name or mt, "model_type": mt, "hidden": c.hidden_size, "vocab": c.vocab_size,
        "params": meta.total, "expert_params": meta.expert, "max_layer_params": meta.max_layer,
        "tied": bool(getattr(c, "tie_word_embeddings", False)), "eager_attention": meta.eager_attention,
        "max_positions": int(getattr(c, "max_position_embeddings", 0) or 0),
        "logit_softcap": bool(getattr(c, "final_logit_softcapping", None)),
    }
    types = list(getattr(c, "layer_types", None) or [])
    if mt not in _READERS:
        kinds = sorted({str(t) for t in types})
        raise ValueError(
            f"the planner has no formulas for model_type {mt!r}"
            + (f" (its layer types: {', '.join(kinds)})" if kinds else "") + ": it models full, sliding and chunked "
            "attention, MLA, DSA, gated DeltaNet, KDA, lightning attention, Mamba2, Mamba-1, short-convolution and "
            "compressed convolutional attention layers, in the "
            f"{len(PLANNER_TYPES)} model types listed in longstraw.planner.families (PLANNER_TYPES), each checked "
            "against its captured prompt state"
        )
    return _READERS[mt](c, mt, n, meta, base, types)
