"""The released checkpoints' values the sweep and the family checks run on (`released.RELEASED`): every entry names its
checkpoint, its values reach the config the check builds and survive the tiny copy (only sizes shrink), the types
recorded as equal to their class defaults still are, and the verdict table says whose values each row used."""

from __future__ import annotations

import pytest
import transformers

from longstraw.admission import check, released
from longstraw.admission.tiny import tiny_config

# Sizes `tiny_config` shrinks (or a layer pattern it cuts to a prefix): not compared after the tiny copy.
_SHRUNK = {"num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
           "shared_expert_intermediate_size", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
           "v_head_dim", "head_dim", "n_group", "topk_group", "num_hidden_layers", "layer_types", "sliding_window",
           "num_attention_heads", "num_key_value_heads", "first_k_dense_replace", "rotary_pct"}


def _text(config):
    return getattr(config, "text_config", None) or config


def _pattern(kinds: list) -> list[int]:
    """A layer-kind list as the pattern it spells (the class may rename the kinds: mamba -> linear_attention)."""
    return [kinds.index(kind) for kind in kinds]


def _holds(config, key: str, value) -> bool:
    """`config` holds `value` under `key` (a rope_parameters dict: every key given, the class may add more; the
    rotated fraction where transformers keeps it, in rope_parameters; a layer-kind list: the same pattern)."""
    if key == "partial_rotary_factor" and not hasattr(config, key):
        return config.rope_parameters["partial_rotary_factor"] == value
    held = getattr(config, key)
    if key == "layer_types":
        return _pattern(list(held)) == _pattern(list(value))
    if isinstance(value, dict) and isinstance(held, dict):
        return all(_holds_item(held, k, v) for k, v in value.items())
    return held == value


def _holds_item(held: dict, key: str, value) -> bool:
    if isinstance(value, dict):
        return isinstance(held.get(key), dict) and all(_holds_item(held[key], k, v) for k, v in value.items())
    return held.get(key) == value


def test_every_released_entry_names_its_checkpoint():
    assert set(released.RELEASED) == set(released.RELEASED_CHECKPOINT) == set(released.RELEASED_SOURCE)
    assert all(released.RELEASED_CHECKPOINT.values()) and all(released.RELEASED_SOURCE.values())
    assert not set(released.RELEASED) & set(released.RELEASED_EQUALS_DEFAULTS)
    assert not set(released.RELEASED_NOT_FOUND) & (set(released.RELEASED) | set(released.RELEASED_EQUALS_DEFAULTS))
    assert set(released.RELEASED) | set(released.RELEASED_EQUALS_DEFAULTS) <= set(released.causal_lm_types()) | {
        "qwen3_5_moe_text"}


@pytest.mark.parametrize("model_type",
                         sorted(t for t in released.RELEASED if "text_config" not in released.RELEASED[t]))
def test_released_values_reach_the_check_and_survive_the_tiny_copy(model_type):
    """The config `longstraw check --all` builds holds every released value, and the tiny float64 copy keeps each one
    that is not a size (a multiplier left at its default 1.0 would hide a missing factor)."""
    values = released.RELEASED[model_type]
    config = released.sweep_config(model_type)
    for key, value in values.items():
        if key == "rotary_pct":  # GPT-NeoX's spelling of the rotated fraction
            key = "partial_rotary_factor"
        assert _holds(config, key, value), f"{model_type}.{key}: {getattr(config, key)!r} != {value!r}"
    tiny, _ = tiny_config(config)
    for key, value in values.items():
        if key in _SHRUNK:
            continue
        if key.endswith("layer_indices"):  # layer indices: those within the tiny copy's prefix of layers
            value = [i for i in value if i < tiny.num_hidden_layers]
            assert value, f"tiny {model_type} keeps none of {key}"
        assert _holds(tiny, key, value), f"tiny {model_type}.{key}: {getattr(tiny, key)!r} != {value!r}"


@pytest.mark.parametrize("model_type", sorted(t for t in released.RELEASED if "text_config" in released.RELEASED[t]))
def test_a_composite_types_released_text_values_reach_its_text_model(model_type):
    text = _text(transformers.AutoConfig.for_model(model_type, **released.RELEASED[model_type]))
    for key, value in released.RELEASED[model_type]["text_config"].items():
        assert _holds(text, key, value), f"{model_type}.text_config.{key}: {getattr(text, key)!r} != {value!r}"


def test_jambas_class_defaults_still_hold_jamba_1_5_minis_values():
    """`RELEASED_EQUALS_DEFAULTS['jamba']`: AI21-Jamba-1.5-Mini's config.json values that change the computation
    (read from it) are JambaConfig's defaults; a transformers that changed one would make the sweep's config wrong."""
    released = dict(attn_layer_offset=4, attn_layer_period=8, expert_layer_offset=1, expert_layer_period=2,
                    hidden_act="silu", mamba_conv_bias=True, mamba_d_conv=4, mamba_d_state=16, mamba_expand=2,
                    mamba_proj_bias=False, num_attention_heads=32, num_key_value_heads=8, num_experts=16,
                    num_experts_per_tok=2, rms_norm_eps=1e-6, router_aux_loss_coef=0.001, tie_word_embeddings=False)
    defaults = transformers.JambaConfig()
    assert {k: getattr(defaults, k) for k in released} == released
    assert defaults.mamba_dt_rank == 256  # "auto" at hidden 4096: the released config's 256


def test_ernie_moes_class_defaults_still_hold_ernie_4_5_21b_a3bs_values():
    """`RELEASED_EQUALS_DEFAULTS['ernie4_5_moe']`: ERNIE-4.5-21B-A3B's config.json values that change the computation
    are Ernie4_5_MoeConfig's defaults."""
    released = dict(num_attention_heads=20, num_key_value_heads=4, hidden_size=2560, num_hidden_layers=28,
                    rms_norm_eps=1e-5, use_bias=False, tie_word_embeddings=True, hidden_act="silu",
                    moe_num_experts=64, moe_k=6, moe_num_shared_experts=2, moe_layer_start_index=1,
                    moe_layer_end_index=27, moe_layer_interval=1)
    defaults = transformers.Ernie4_5_MoeConfig()
    assert {k: getattr(defaults, k) for k in released} == released
    assert dict(defaults.rope_parameters or {})["rope_theta"] == 500_000.0
    assert defaults.hidden_size // defaults.num_attention_heads == 128  # the released head_dim


def test_glms_class_defaults_still_hold_glm_4_9b_chat_hfs_values():
    """`RELEASED_EQUALS_DEFAULTS['glm']`: glm-4-9b-chat-hf's config.json values that change the computation are
    GlmConfig's defaults (its config.json omits partial_rotary_factor: the class's 0.5 is what it runs with)."""
    released = dict(num_attention_heads=32, num_key_value_heads=2, head_dim=128, hidden_size=4096, attention_bias=True,
                    hidden_act="silu", rms_norm_eps=1.5625e-07, tie_word_embeddings=False)
    defaults = transformers.GlmConfig()
    assert {k: getattr(defaults, k) for k in released} == released
    rope = dict(defaults.rope_parameters or {})
    assert (rope["rope_theta"], rope["partial_rotary_factor"]) == (10_000.0, 0.5)


def test_the_verdict_table_says_whose_values_each_row_used():
    rows = [
        {"model_type": "gemma3_text", "kind": "exact within float32 kernels", "logprob_error": 1e-15,
         "gradient_error": 4e-8, "sampled_error": 0.0, "tolerance": 1e-6, "decoder_only_text": True},
        {"model_type": "jamba", "kind": "exact within float32 kernels", "logprob_error": 1e-15,
         "gradient_error": 1e-8, "sampled_error": 0.0, "tolerance": 1e-6, "decoder_only_text": True},
        {"model_type": "llama", "kind": "exact within float32 kernels", "logprob_error": 1e-15,
         "gradient_error": 1e-8, "sampled_error": 0.0, "tolerance": 1e-6, "decoder_only_text": True},
    ]
    table = check.markdown(rows, "a test")
    assert "| `gemma3_text` | exact within float32 kernels | max error 4.0e-08 (tolerance 1e-06) | values of " \
           "google/gemma-3-27b-it |" in table
    assert "| class defaults, checked equal to ai21labs/AI21-Jamba-1.5-Mini |" in table
    assert table.rstrip().endswith("| `llama` | exact within float32 kernels | max error 1.0e-08 (tolerance 1e-06) | "
                                   "class defaults |")


def test_the_released_configs_ship_as_package_data():
    """The data file sits in the package and the project ships it (an installed wheel reads it)."""
    import tomllib
    from importlib import resources
    from pathlib import Path

    assert resources.files("longstraw.admission").joinpath("released_configs.json").is_file()
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert "released_configs.json" in pyproject["tool"]["setuptools"]["package-data"]["longstraw.admission"]
