"""The tiny copy of a config that admission checks: the model type and every multiplier, scale, flag, sink, router
setting and the pattern of layer kinds are kept; only sizes shrink (width, heads, experts, vocabulary, depth down to
the shortest prefix of layers that holds every layer kind, windows and attention chunks below the test prompt).
`build_tiny_model` instantiates it in float64 with random weights."""

from __future__ import annotations

import copy
from typing import Any

import torch
import transformers

from longstraw.engine.hf.composite import language_config
from longstraw.models.sources import is_int

VOCAB = 512
# Layers of the tiny copy at most: a layer-kind pattern longer than this is cut (said in the verdict).
MAX_LAYERS = 12
# Layers of the meta-device model the layer kinds are read from at most (building all of a 100,000-layer config's
# layers takes minutes, and a tiny copy keeps at most MAX_LAYERS of them).
PROBE_LAYERS = 48

_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_k", "top_k", "moe_topk", "num_selected_experts")
# Config fields that are sizes, and the size each takes in the tiny copy (only where the config has the field and
# its value is larger): widths (GPT-2 style `n_inner`: None for 4 x hidden), counts, windows, experts per token.
# Everything else (multipliers, scales, flags, rope parameters, router settings) is kept.
_SIZES: dict[str, int] = {
    "hidden_size": 64, "intermediate_size": 96, "ffn_hidden_size": 96, "head_dim": 16, "attention_head_dim": 16,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32, "shared_intermediate_size": 32, "dense_intermediate_size": 96,
    "intermediate_size_mlp": 96, "moe_ffn_hidden_size": 32, "mlp_hidden_size": 96,
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "qk_head_dim": 16, "index_head_dim": 16, "index_n_heads": 16, "index_topk": 24,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 8, "linear_num_heads": 4,
    "mamba_n_heads": 8, "mamba_num_heads": 8, "mamba_d_head": 16, "mamba_head_dim": 16, "mamba_d_state": 16,
    "ssm_state_size": 16, "state_size": 16, "mamba_chunk_size": 16, "chunk_size": 16, "mamba_d_ssm": 128,
    "mamba_n_groups": 1, "n_groups": 1, "time_step_rank": 8, "num_heads": 8,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "n_group": 1, "topk_group": 1, "adapter_rank": 8, "lru_width": 64,
    "sliding_window": 16, "attention_window_size": 16, "attention_chunk_size": 16, "window_size": 16,
    "max_window_layers": 0, "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16, "n_inner": 96,
    **dict.fromkeys(_TOP_K, 2),
}
# Parameters the tiny copy may have at most: more means a size field this module does not know stayed large.
MAX_PARAMS = 20_000_000
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "num_layers")
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id")


def _per_layer_fields(data: dict[str, Any], n: int) -> list[str]:
    """Fields holding one entry per layer (a list or a string of length n: layer types, block patterns)."""
    return [k for k, v in data.items() if isinstance(v, (list, str)) and len(v) == n and n > 1
            and any(word in k for word in ("layer", "pattern", "block", "types"))]


def _layer_index_fields(data: dict[str, Any], n: int) -> list[str]:
    """Fields holding a sorted list of layer indices (e.g. which layers are hybrid or dense)."""
    return [k for k, v in data.items()
            if isinstance(v, list) and v and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
            and all(0 <= i < n for i in v) and v == sorted(v) and len(v) < n and "layer" in k]


def _field(config: Any, key: str) -> Any:
    """config.key via the config's attribute map (GPT-2's n_embd answers hidden_size); None if absent or per-layer."""
    try:
        return getattr(config, key, None)
    except Exception:  # e.g. Gemma-4's per-layer head dims: no single value
        return None


def _shrink_widths(config: Any) -> Any:
    """A copy of `config` with every size field shrunk (depth unchanged)."""
    c = copy.deepcopy(language_config(config))
    heads = _field(c, "num_attention_heads")
    if is_int(heads) and heads > 4:
        kv = _field(c, "num_key_value_heads")
        c.num_attention_heads = 4
        if is_int(kv):  # multi-head stays multi-head, one head stays one, grouped becomes 2 groups
            c.num_key_value_heads = 4 if kv == heads else 1 if kv == 1 else 2
    for key, size in _SIZES.items():
        value = _field(c, key)
        if is_int(value) and value > size:
            setattr(c, key, size)
    if "head_dim" in c.to_dict() and c.to_dict()["head_dim"] is None:  # hidden / heads: say it (some read it as is)
        c.head_dim = 16
    widths = _field(c, "intermediate_size")
    if isinstance(widths, list):  # per-layer widths (Gemma-3n)
        c.intermediate_size = [min(v, _SIZES["intermediate_size"]) if is_int(v) else v for v in widths]
    width, old_hidden = _field(c, "attention_hidden_size"), _field(language_config(config), "hidden_size")
    hidden, heads = _field(c, "hidden_size"), _field(c, "num_attention_heads")
    if is_int(width) and is_int(old_hidden) and is_int(hidden) and is_int(heads):
        c.attention_hidden_size = width * hidden // old_hidden  # Zamba2's attention over [hidden ; embeddings]: 2x
        if is_int(_field(c, "attention_head_dim")):
            c.attention_head_dim = c.attention_hidden_size // heads
    heads, expand, hidden = _field(c, "n_mamba_heads"), _field(c, "mamba_expand"), _field(c, "hidden_size")
    if is_int(heads) and is_int(expand) and is_int(hidden) and is_int(_field(c, "mamba_headdim")):
        c.mamba_headdim = expand * hidden // heads  # Zamba2: the heads split expand x hidden
    heads, head = _field(c, "mamba_n_heads"), _field(c, "mamba_d_head")
    if is_int(heads) and is_int(head) and is_int(_field(c, "mamba_d_ssm")):  # the SSM width is heads x head dim
        c.mamba_d_ssm = heads * head
    rotary, old_head = _field(c, "rotary_dim"), _head_dim(config)
    if is_int(rotary) and old_head:  # a partial rotary width keeps its share of the head (CodeGen, GPT-J)
        c.rotary_dim = max(2, 2 * round(rotary * _head_dim(c) / old_head / 2))
    positions = _field(c, "max_position_embeddings")
    if is_int(positions) and positions > 4096 and _learned_positions(c):
        c.max_position_embeddings = 4096
    rope, nope = _field(c, "qk_rope_head_dim"), _field(c, "qk_nope_head_dim")
    if is_int(rope):  # MLA: the RoPE head dim is `head_dim`, q/k heads nope + rope
        if is_int(_field(c, "head_dim")):
            c.head_dim = rope
        if is_int(_field(c, "qk_head_dim")):
            c.qk_head_dim = rope + (nope if is_int(nope) else 0)
    vocab = _field(c, "vocab_size")
    if is_int(vocab) and vocab > VOCAB:
        c.vocab_size = VOCAB
        for key in _TOKEN_IDS:
            value = _field(c, key)
            if is_int(value) and value >= VOCAB:
                setattr(c, key, VOCAB - 1 - _TOKEN_IDS.index(key))
            elif isinstance(value, list):
                setattr(c, key, [i if i < VOCAB else VOCAB - 1 for i in value])
    return c


def _head_dim(config: Any) -> int:
    """The attention head size: `head_dim` where the config says it, else hidden / heads."""
    head = _field(config, "head_dim")
    if is_int(head):
        return head
    hidden, heads = _field(config, "hidden_size"), _field(config, "num_attention_heads")
    return hidden // heads if is_int(hidden) and is_int(heads) and heads else 0


def _learned_positions(config: Any) -> bool:
    """Whether the model learns a position embedding table (GPT-2, OPT, BLOOM's ALiBi has none): its size is then
    max_position_embeddings x hidden, which a long-context config makes large."""
    return str(_field(config, "position_embedding_type") or "absolute") == "absolute" and _field(
        config, "rope_parameters") is None and _field(config, "rope_theta") is None


def _layer_signature(layer: torch.nn.Module) -> str:
    """What kind of decoder layer this is: its modules' classes and the attention's window and kind attributes."""
    parts = [type(m).__name__ for m in layer.modules()]
    for m in layer.modules():
        for attr in ("sliding_window", "is_sliding", "attention_type", "use_rope", "layer_type", "is_causal",
                     "attention_chunk_size", "use_sliding_window"):
            value = getattr(m, attr, None)
            if isinstance(value, (int, float, str, bool)):
                parts.append(f"{attr}={value}")
    return "|".join(parts)


def _layer_kinds(config: Any) -> list[str]:
    """The signature of every decoder layer of `config` (built on the meta device: no memory)."""
    from longstraw.engine.activation_checkpointing import decoder_layers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    if total > MAX_PARAMS * 4:  # the full depth: its prefix is cut below
        name, largest = max(((n, p) for n, p in model.named_parameters()), key=lambda item: item[1].numel())
        raise ValueError(f"the shrunk config still has {total / 1e6:.0f}M parameters (largest: {name} "
                         f"{tuple(largest.shape)}): a size field of {type(config).__name__} is not shrunk")
    return [_layer_signature(layer) for layer in decoder_layers(model)]


def _cut_depth(wide: Any, data: dict[str, Any], n: int, keep: int, count_key: str) -> Any:
    """`wide` with its first `keep` of `n` layers: the layer count, per-layer fields and layer-index lists cut."""
    tiny = copy.deepcopy(wide)
    for key in _per_layer_fields(data, n):
        setattr(tiny, key, data[key][:keep])
    for key in _layer_index_fields(data, n):
        setattr(tiny, key, [i for i in data[key] if i < keep])
    setattr(tiny, count_key, keep)
    return tiny


def _kinds_after(data: dict[str, Any], n: int, probe: int) -> bool:
    """Whether the config says of some layer past the first `probe` something none of those says: a per-layer value
    not among the first `probe` layers' values, or a layer-index list naming a layer past them."""
    return (any({str(v) for v in data[key][probe:]} - {str(v) for v in data[key][:probe]}
                for key in _per_layer_fields(data, n))
            or any(i >= probe for key in _layer_index_fields(data, n) for i in data[key]))


def tiny_config(config: Any) -> tuple[Any, str]:
    """The tiny copy of `config` (see the module's docstring) and a note on what depth was kept. The layer kinds are
    read from a meta-device model of at most `PROBE_LAYERS` layers (a deeper config's per-layer fields are compared
    beyond them without building anything), so a config of any depth is shrunk in about a second."""
    wide = _shrink_widths(config)
    count_key = next((k for k in _LAYER_COUNTS if isinstance(getattr(wide, k, None), int)), None)
    if count_key is None:
        raise ValueError(f"{type(wide).__name__} has no layer count ({', '.join(_LAYER_COUNTS)})")
    n = int(getattr(wide, count_key))
    data = wide.to_dict()
    probe = min(n, PROBE_LAYERS)
    kinds = _layer_kinds(wide if probe == n else _cut_depth(wide, data, n, probe, count_key))
    first_of = {kind: i for i, kind in reversed(list(enumerate(kinds)))}  # each kind's first layer
    keep = min(max(2, max(first_of.values()) + 1) if kinds else 2, n)
    note = f"{keep} of {n} layers ({len(first_of)} layer kinds)"
    if keep > MAX_LAYERS or (probe < n and _kinds_after(data, n, probe)):
        keep, note = MAX_LAYERS, f"{MAX_LAYERS} of {n} layers: the layer-kind pattern ({len(first_of)} kinds) is cut"
    return (wide if keep == n else _cut_depth(wide, data, n, keep, count_key)), note


def build_tiny_model(config: Any, seed: int = 0) -> torch.nn.Module:
    """A float64, eval-mode, random-init causal LM of `config` (eager experts: grouped_mm has no float64)."""
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {"experts_implementation": "eager"}
    try:
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", **kwargs)
    except (ValueError, TypeError):  # no sdpa path (e.g. no attention layers)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", **kwargs)
    model = model.to(torch.float64).eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return model
