"""The planner's prompt-state formula against the captured state of every family it reads generically from its
config (`planner.spec`: plain attention, MLA, DSA, Mamba2 and gated-DeltaNet hybrids, short convolutions): the tiny
float64 copy `longstraw check` verifies (`verify.tiny_config` of the sweep's config: the class defaults with a
released checkpoint's values), captured over 40 positions in 16-token chunks, with every chunk boundary kept (exact)
and lean (detach: sliding layers drop the chunks no later token sees). The bytes must be equal, not close."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import _arch_configs

from longstraw import planner
from longstraw.engine.state.capture import capture_prompt
from longstraw.models import check, verify
from longstraw.planner import spec as planner_spec

GENERIC_TYPES = (planner_spec.ATTENTION_MODEL_TYPES + planner_spec.MLA_MODEL_TYPES + planner_spec.DSA_MODEL_TYPES
                 + planner_spec.MAMBA2_HYBRID_TYPES + planner_spec.GATED_DELTANET_TYPES
                 + planner_spec.SHORT_CONV_TYPES)
# Types whose class-default config builds no model (Nemotron-4's has no num_key_value_heads): the parity family's
# config (tests/helpers.py, a released checkpoint's values) stands in.
PARITY_CONFIG = {"nemotron": "nemotron"}


def _config(model_type: str):
    if model_type in PARITY_CONFIG:
        return _arch_configs()[PARITY_CONFIG[model_type]]()
    tiny, _ = verify.tiny_config(check.sweep_config(model_type))
    return tiny


@pytest.mark.parametrize("model_type", GENERIC_TYPES)
def test_planner_state_bytes_equal_the_captured_state(model_type):
    model = verify.build_tiny_model(_config(model_type))
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
    config = transformers.AutoConfig.for_model(model_type, **{**check.RELEASED.get(model_type, {}),
                                                              **WINDOWED[model_type]})
    tiny, _ = verify.tiny_config(config)
    model = verify.build_tiny_model(tiny)
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
    types = set(check.causal_lm_types())
    assert set(GENERIC_TYPES) <= types | {"qwen3_5_moe_text"}


def test_an_unmodelled_layer_type_is_named():
    """Llama 4's chunked-attention layers are not modelled: the error names the layer type, not a wrong number."""
    config = transformers.Llama4TextConfig(
        hidden_size=64, intermediate_size=96, intermediate_size_mlp=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=512, num_local_experts=4, attention_chunk_size=16)
    with pytest.raises(ValueError, match=r"llama4_text.*chunked_attention"):
        planner.spec_from_config(config)
