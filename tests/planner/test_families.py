"""The planner's prompt-state formula against the captured state of every family it reads generically from its
config (`planner.families`: plain attention, MLA, DSA, Mamba2 and gated-DeltaNet hybrids, short convolutions): the tiny
float64 copy `longstraw check` verifies (`tiny_config` of the sweep's config: the class defaults with a
released checkpoint's values), captured over 40 positions in 16-token chunks, with every chunk boundary kept (exact)
and lean (detach: sliding layers drop the chunks no later token sees). The bytes must be equal, not close."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import _arch_configs

from longstraw import planner
from longstraw.admission import released
from longstraw.admission.tiny import build_tiny_model, tiny_config
from longstraw.engine.state.capture import capture_prompt
from longstraw.planner import config_fields as planner_fields

GENERIC_TYPES = (planner_fields.ATTENTION_MODEL_TYPES + planner_fields.MLA_MODEL_TYPES
                 + planner_fields.DSA_MODEL_TYPES + planner_fields.MAMBA2_HYBRID_TYPES
                 + planner_fields.GATED_DELTANET_TYPES + planner_fields.SHORT_CONV_TYPES
                 + planner_fields.LIGHTNING_TYPES + planner_fields.SHARED_BLOCK_TYPES + planner_fields.CCA_TYPES)
# Causal-LM types whose config is another type's (GPT-SW3: a GPT-2 config; Llama-4: its text model's).
ALIAS_TYPES = ("gpt-sw3", "llama4")
# Types whose class-default config builds no model (Nemotron-4's has no num_key_value_heads): the parity family's
# config (tests/helpers.py, a released checkpoint's values) stands in.
PARITY_CONFIG = {"nemotron": "nemotron"}


def _config(model_type: str):
    if model_type in PARITY_CONFIG:
        return _arch_configs()[PARITY_CONFIG[model_type]]()
    tiny, _ = tiny_config(released.sweep_config(model_type))
    return tiny


@pytest.mark.parametrize("model_type", GENERIC_TYPES + ALIAS_TYPES)
def test_planner_state_bytes_equal_the_captured_state(model_type):
    model = build_tiny_model(_config(model_type))
    spec = planner.spec_from_config(model.config, model_type)
    state = capture_prompt(model, torch.arange(40), chunk_size=16)  # 3 chunks, all boundaries kept
    lean = capture_prompt(model, torch.arange(40), chunk_size=16, keep_boundaries=False)
    assert (state.nbytes(), lean.nbytes()) == (planner.state_bytes(spec, 40, 8, 16, exact=True)[0],
                                               planner.state_bytes(spec, 40, 8, 16, exact=False)[0])


# Window settings the class defaults leave off: `sliding_window` on every layer (no `layer_types`), and Qwen2's
# `use_sliding_window` above `max_window_layers` (transformers derives `layer_types` from them).
WINDOWED = {
    "phi3": {"sliding_window": 16}, "mixtral": {"sliding_window": 16}, "ministral3": {"sliding_window": 16},
    "qwen3_moe": {"use_sliding_window": True, "sliding_window": 16},
    "qwen2": {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
}


@pytest.mark.parametrize("model_type", sorted(WINDOWED))
def test_planner_state_bytes_with_sliding_windows(model_type):
    config = transformers.AutoConfig.for_model(model_type, **{**released.RELEASED.get(model_type, {}),
                                                              **WINDOWED[model_type]})
    tiny, _ = tiny_config(config)
    model = build_tiny_model(tiny)
    spec = planner.spec_from_config(model.config, model_type)
    assert "sliding" in spec.mixers
    state = capture_prompt(model, torch.arange(40), chunk_size=16)
    lean = capture_prompt(model, torch.arange(40), chunk_size=16, keep_boundaries=False)
    assert lean.nbytes() < state.nbytes()
    assert (state.nbytes(), lean.nbytes()) == (planner.state_bytes(spec, 40, 8, 16, exact=True)[0],
                                               planner.state_bytes(spec, 40, 8, 16, exact=False)[0])


def test_every_sweep_type_reads_its_own_model_type():
    """Each generic type is a model type some causal-LM class of this transformers has (a text config's own type
    for the multimodal wrappers: `qwen3_5_moe_text`), so no entry of the lists is dead."""
    types = set(released.causal_lm_types())
    assert set(GENERIC_TYPES) <= types | {"qwen3_5_moe_text"}


# Layer types the planner does not model: MiniMax-M3's sparse layers (their indexer keeps keys of its own and selects
# key blocks), ZAYA's windowed compressed-convolutional layers.
UNMODELLED = {
    "minimax_m3_vl_text": {"layer_types": ["full_attention", "minimax_m3_sparse"], "bos_token_id": 1,
                           "eos_token_id": 2},
    "zaya": {"layer_types": ["hybrid", "hybrid_sliding"], "sliding_window": 16},
}


@pytest.mark.parametrize("model_type", sorted(UNMODELLED))
def test_an_unmodelled_layer_type_is_named(model_type):
    """The error names the family and the layer type, not a wrong number."""
    config = transformers.AutoConfig.for_model(
        model_type, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, **UNMODELLED[model_type])
    kind = UNMODELLED[model_type]["layer_types"][1]
    with pytest.raises(ValueError, match=rf"{model_type}: .*layer type '{kind}'"):
        planner.spec_from_config(config)


def _gemma4(**changes):
    """A tiny Gemma-4 text config: sliding and full layers alternating (full layers with their own head dim), the
    last two layers reusing the K/V of the last earlier layer of their kind."""
    layer_types = ["sliding_attention", "full_attention"] * 3
    return transformers.Gemma4TextConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, vocab_size=512, vocab_size_per_layer_input=512,
        hidden_size_per_layer_input=16, sliding_window=16, num_kv_shared_layers=2, layer_types=layer_types, **changes)


@pytest.mark.parametrize("changes", [{}, {"attention_k_eq_v": True, "num_global_key_value_heads": 1}],
                         ids=["own-v", "k-eq-v"])
def test_gemma4_kv_shared_layers_and_per_layer_head_dims(changes):
    """Gemma-4: full layers with a head dim of their own (and, with `attention_k_eq_v`, their own K/V head count),
    KV-shared layers that keep no state; the prompt-backward chunk stops at the last layer that keeps some."""
    model = build_tiny_model(_gemma4(**changes))
    spec = planner.spec_from_config(model.config)
    full_kv = 1 if changes else 2
    assert spec.layer_kv == ((32, 32), (full_kv * 32,) * 2) * 2 + ((0, 0),) * 2
    assert planner.formulas.last_state_layer(spec) == 3
    state = capture_prompt(model, torch.arange(40), chunk_size=16)
    lean = capture_prompt(model, torch.arange(40), chunk_size=16, keep_boundaries=False)
    assert state.keys[4] == state.keys[5] == [None] * 3
    assert (state.nbytes(), lean.nbytes()) == (planner.state_bytes(spec, 40, 8, 16, exact=True)[0],
                                               planner.state_bytes(spec, 40, 8, 16, exact=False)[0])


def test_llama4_chunked_layers_keep_every_position_and_take_the_masked_path():
    """Llama-4's chunked layers: a query sees only its own `attention_chunk_size` positions, yet the state keeps every
    position (as full attention's), in the lean capture too; their attention runs the masked path."""
    config = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=96, intermediate_size_mlp=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, num_local_experts=4, attention_chunk_size=16)
    model = build_tiny_model(config)
    spec = planner.spec_from_config(model.config)
    assert spec.mixers == ("chunked",) * 3 + ("attention",)
    assert planner.formulas.masked_layers(spec) == 3
    lean = capture_prompt(model, torch.arange(40), chunk_size=16, keep_boundaries=False)
    assert lean.nbytes() == 4 * 40 * 2 * 2 * 16 * 8 == planner.state_bytes(spec, 40, 8, 16, exact=False)[0]


class _LinearCache:
    """What MiniMax's lightning attention asks of a cache: the K^T V state it continues, and where its new one goes."""

    def __init__(self, state):
        self.state = state

    def get_linear_cache(self, layer_idx):
        return self.state

    def set_linear_cache(self, layer_idx, state):
        self.state = state


@pytest.mark.parametrize(("cached", "tokens", "tolerance"), [(True, 64, 0.01), (False, 512, 0.03)])
def test_lightning_attention_saved_bytes(cached, tokens, tolerance):
    """MiniMax's lightning attention continuing a state (LongStraw's replays) saves one (H, d, d) state per token;
    from scratch (the standard plans) per block of 256 the intra-block scores: `recurrent_bytes` against the bytes
    autograd's saved-tensor hooks see (parameters, buffers and the input left out)."""
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    config = transformers.MiniMaxConfig(
        hidden_size=128, num_attention_heads=4, head_dim=32, num_key_value_heads=2, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], intermediate_size=96, vocab_size=512,
        num_local_experts=2)
    layer = MiniMaxLightningAttention(config, 0).double()
    x = torch.randn(1, tokens, 128, dtype=torch.float64, requires_grad=True)
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    cache = _LinearCache(torch.randn(1, 4, 32, 32, dtype=torch.float64)) if cached else None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, (None, None), None, cache=cache)
    outside = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), *layer.buffers(), x]}
    saved = sum(n for ptr, n in storages.items() if ptr not in outside)
    spec = planner.spec_from_config(config)
    formula = planner.recurrent.recurrent_bytes(spec, "lightning", tokens, 8, cached=cached).saved
    assert abs(formula / saved - 1) < tolerance
    if cached:
        assert saved > tokens * 4 * 32 * 32 * 8  # one state per token
