"""Expected size of the prompt state per layer kind (DESIGN §4), from a transformers config.

The tests check `PromptState.nbytes()` against these formulas for every family, so a state that silently
keeps more (or less) than it should is caught. Per layer:

* full attention (GQA/MQA): 2 · Hkv · D · bytes per token;
* sliding window: the same over the positions kept (whole capture chunks that reach into the last W-1);
* MLA latent attention: (d_c + d_R) · bytes per token; DSA adds the indexer key, d_I · bytes per token;
* gated DeltaNet / KDA: conv window (C · K) + recurrent state (H · d_k · d_v), per kept boundary;
* Mamba2: conv window (C · K) + SSM state (H · d_h · N), per kept boundary.
"""

from __future__ import annotations

import torch


def _size(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


def attention_bytes_per_token(config, layer: int, dtype: torch.dtype) -> int:
    """Bytes one prompt token adds to an attention layer's state (0 for a layer without attention)."""
    kind = layer_kind(config, layer)
    b = _size(dtype)
    if kind in ("linear", "mamba"):
        return 0
    if kind in ("mla", "dsa"):
        per = (config.kv_lora_rank + config.qk_rope_head_dim) * b
        if kind == "dsa":
            per += config.index_head_dim * b
        return per
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_key_value_heads * head_dim * b


def recurrent_bytes(config, layer: int, dtype: torch.dtype, state_dtype: torch.dtype) -> int:
    """Bytes of one boundary's conv window (in `dtype`) + recurrent state (in `state_dtype`) of a layer."""
    kind = layer_kind(config, layer)
    model_type = config.model_type
    if kind == "linear" and model_type in ("qwen3_next", "qwen3_5_text"):
        key_dim = config.linear_key_head_dim * config.linear_num_key_heads
        value_dim = config.linear_value_head_dim * config.linear_num_value_heads
        conv = (2 * key_dim + value_dim) * config.linear_conv_kernel_dim
        rec = config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    elif kind == "linear" and model_type == "kimi_linear":
        qkv = config.linear_num_heads * config.linear_head_dim
        conv = 3 * qkv * config.linear_conv_kernel_dim
        rec = config.linear_num_heads * config.linear_head_dim * config.linear_head_dim
    elif kind == "mamba" or (model_type == "falcon_h1"):
        heads, head_dim, n, groups, k = _mamba_dims(config)
        conv = (heads * head_dim + 2 * groups * n) * k
        rec = heads * head_dim * n
    else:
        return 0
    return conv * _size(dtype) + rec * _size(state_dtype)


def _mamba_dims(config) -> tuple[int, int, int, int, int]:
    """(heads, head_dim, state N, groups, conv kernel) of a Mamba2 mixer."""
    if config.model_type == "falcon_h1":
        heads = config.mamba_n_heads
        head_dim = config.mamba_d_head if config.mamba_d_head != "auto" else (
            config.mamba_expand * config.hidden_size // heads)
        return heads, head_dim, config.mamba_d_state, config.mamba_n_groups, config.mamba_d_conv
    return config.num_heads, config.head_dim, config.state_size, config.n_groups, config.conv_kernel


def layer_kind(config, layer: int) -> str:
    """attention | sliding | mla | dsa | linear | mamba (falcon_h1: attention, plus a parallel mamba mixer)."""
    model_type = config.model_type
    if model_type == "mamba2":
        return "mamba"
    if model_type in ("deepseek_v3",):
        return "mla"
    if model_type == "glm_moe_dsa":
        return "dsa" if config.indexer_types[layer] != "shared" else "mla"
    layer_types = getattr(config, "layer_types", None)
    kind = layer_types[layer] if layer_types else "full_attention"
    if kind == "linear_attention":
        return "linear"
    if model_type == "kimi_linear":
        return "mla"
    if kind == "sliding_attention" or (model_type == "mistral" and getattr(config, "sliding_window", None)):
        return "sliding"
    return "attention"


def expected_state_bytes(config, positions: int, dtype: torch.dtype, boundaries: int = 1,
                         state_dtype: torch.dtype | None = None, kept_positions: dict[int, int] | None = None) -> int:
    """Bytes of a prompt state holding `positions` tokens: attention parts per token (a sliding layer's
    `kept_positions[layer]` if given), recurrent parts once per kept chunk boundary (`boundaries`)."""
    state_dtype = state_dtype or dtype
    total = 0
    for layer in range(config.num_hidden_layers):
        kept = positions if kept_positions is None else kept_positions.get(layer, positions)
        total += attention_bytes_per_token(config, layer, dtype) * kept
        total += recurrent_bytes(config, layer, dtype, state_dtype) * boundaries
    return total
