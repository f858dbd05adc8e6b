"""Built-in model presets: random-init transformers configs by name (`load_model("b1-llama")`).

Tests and benchmarks build these instead of downloading weights: tiny models for parity tests, the Bench B1
shape per architecture family (`b1-*`), a ~1B model for the GPU bench, and SmolLM2-135M's 30-layer shape with
random weights (`deep-smollm2`) for the planner at depth.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import (
    DeepseekV3Config,
    LlamaConfig,
    Mamba2Config,
    PretrainedConfig,
    Qwen3Config,
    Qwen3NextConfig,
)


# Each preset is one config literal; presets of one family share their shape on purpose (duplicates lists them):
# a reader sees every number of a preset in one place.
def _tiny_llama() -> PretrainedConfig:
    return LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048, tie_word_embeddings=False,
    )


def _tiny_qwen3() -> PretrainedConfig:
    return Qwen3Config(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, vocab_size=512, max_position_embeddings=2048,
        tie_word_embeddings=True,
    )


def _b1_llama() -> PretrainedConfig:
    """Bench B1 (docs/design.md §5): 4 layers, hidden 256, 8 heads, 2 KV heads, intermediate 704, vocab 32000."""
    return LlamaConfig(
        hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, vocab_size=32000, max_position_embeddings=131072, tie_word_embeddings=False,
    )


def _b1_qwen3() -> PretrainedConfig:
    """The B1 shape (docs/design.md §5) as Qwen3: q/k RMSNorm, head_dim 32, tied embeddings (planner validation)."""
    return Qwen3Config(
        hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, vocab_size=32000, max_position_embeddings=131072,
        tie_word_embeddings=True,
    )


def _gpu_llama_1b() -> PretrainedConfig:
    """~1.3B-parameter Llama-style model for the GPU bench (bench/gpu.sh): 24 layers, hidden 2048, GQA 16/8."""
    return LlamaConfig(
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=24, num_attention_heads=16,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=262144, tie_word_embeddings=False,
    )


def _b1_qwen3_next() -> PretrainedConfig:
    """The B1 shape as a Qwen3-Next hybrid: 3 gated-DeltaNet layers then 1 full-attention layer, MoE FFNs
    (8 experts, 2 active + a shared expert, ~B1's active FFN width)."""
    return Qwen3NextConfig(
        hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
        head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_num_key_heads=4, linear_num_value_heads=8, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=352, shared_expert_intermediate_size=352, vocab_size=32000,
        max_position_embeddings=1 << 21, layer_types=["linear_attention"] * 3 + ["full_attention"],
        tie_word_embeddings=False,
    )


def _b1_deepseek_v3() -> PretrainedConfig:
    """The B1 shape as DeepSeek-V3: MLA (latent 64 + rope key 16 per token and layer), MoE after layer 0."""
    return DeepseekV3Config(
        hidden_size=256, intermediate_size=704, moe_intermediate_size=352, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=64,
        q_lora_rank=96, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, vocab_size=32000,
        max_position_embeddings=131072, tie_word_embeddings=False,
    )


def _b1_mamba2() -> PretrainedConfig:
    """The B1 shape as Mamba2 (no attention: the state is constant in P): 4 layers, hidden 256, 16 heads x 32,
    state 64."""
    return Mamba2Config(
        hidden_size=256, num_hidden_layers=4, num_heads=16, head_dim=32, expand=2, state_size=64, n_groups=1,
        conv_kernel=4, chunk_size=256, vocab_size=32000, tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def _tiny_llama_long() -> PretrainedConfig:
    """tiny-llama with 16M positions: the full-attention model of the stress record (`benchmarks.stress`)."""
    config = _tiny_llama()
    config.max_position_embeddings = 2**24
    return config


def _deep_smollm2() -> PretrainedConfig:
    """SmolLM2-135M's shape (30 layers, hidden 576, 9 heads, 3 KV heads, intermediate 1536, vocab 49152, tied
    embeddings) with 131,072 positions and random weights: the planner's validation at depth (memory and time
    do not depend on the weights; the real model is trained for 8,192 positions)."""
    return LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, max_position_embeddings=131072, tie_word_embeddings=True,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    )


def _tiny_mamba2() -> PretrainedConfig:
    """A tiny Mamba2 (2 layers, hidden 64): its state does not grow with P (the stress record's model)."""
    return Mamba2Config(
        hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=1,
        conv_kernel=4, chunk_size=256, vocab_size=512, tie_word_embeddings=False,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


PRESETS: dict[str, Callable[[], PretrainedConfig]] = {
    "tiny-llama": _tiny_llama,
    "tiny-qwen3": _tiny_qwen3,
    "tiny-mamba2": _tiny_mamba2,
    "b1-llama": _b1_llama,
    "b1-qwen3": _b1_qwen3,
    "b1-qwen3-next": _b1_qwen3_next,
    "b1-deepseek-v3": _b1_deepseek_v3,
    "b1-mamba2": _b1_mamba2,
    "gpu-llama-1b": _gpu_llama_1b,
    "tiny-llama-long": _tiny_llama_long,
    "deep-smollm2": _deep_smollm2,
}
