"""What the tests share: tiny random models of every supported family (float64-faithful), random groups, flat
gradients, and `assert_close` with the tolerances of each kernel class. Imported as `from helpers import ...`
(tests/ is on pytest's pythonpath); the fixtures live in conftest.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    Cohere2Config,
    DeepseekV3Config,
    FalconH1Config,
    FalconMambaConfig,
    Gemma3Config,
    Gemma3TextConfig,
    Gemma4TextConfig,
    Glm4MoeConfig,
    GlmMoeDsaConfig,
    GptOssConfig,
    JambaConfig,
    Llama4TextConfig,
    LlamaConfig,
    Mamba2Config,
    MambaConfig,
    MiniMaxConfig,
    MistralConfig,
    NemotronConfig,
    NemotronHConfig,
    Qwen2Config,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3NextConfig,
    StableLmConfig,
    Zamba2Config,
)

from longstraw import Group, Trajectory
from longstraw.engine.kernels.attention import prefix_attention
from longstraw.models.architecture import CI_TRANSFORMERS, on_the_ci_list, transformers_too_old

# Kimi Linear exists from transformers 5.17 on: on an older one its families are listed and their tests skip.
KimiLinearConfig = getattr(transformers, "KimiLinearConfig", None)

VOCAB = 512


def _rms_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


def _gemma_rms_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _weightless_rms_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def _layer_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    centred = x - x.mean(-1, keepdim=True)
    return self.weight * (centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _llama4_rms_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    return self._norm(x) * self.weight


def _llama4_l2_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    return self._norm(x)


def _gemma4_rms_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    return self._norm(x) * self.weight if self.with_scale else self._norm(x)


def _logits_in_input_dtype(model: torch.nn.Module) -> None:
    """Nemotron-H's, Mamba's and Falcon-Mamba's causal LMs return `lm_head(h).float()`: an upcast for a bf16 or fp32
    model, a rounding to float32 in a float64 one. Its output's logits are replaced by the output projection's own
    (float64) result: a hook on `lm_head` keeps it and a hook on the model hands it back."""
    kept: dict[str, torch.Tensor] = {}
    model.get_output_embeddings().register_forward_hook(lambda module, args, out: kept.update(logits=out))

    def restore(module, args, out):
        if "logits" in kept:
            out.logits = kept.pop("logits")
        return out

    model.register_forward_hook(restore)


def faithful_float64(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' RMSNorm computes in float32 and casts back, which in a float64 model *rounds to
    float32*: two mathematically equal paths then differ by ~1e-8 of float32 rounding noise, and float64
    parity at 1e-10 would be meaningless. Tests patch every RMSNorm instance (both sides of every comparison
    use the same model object) to compute in the input dtype, and likewise Cohere2's LayerNorm, the float32 logits of
    Nemotron-H, Mamba and Falcon-Mamba, and Falcon-Mamba's weightless norms. Library code is untouched."""
    for module in model.modules():
        name = type(module).__name__
        if name == "Gemma3RMSNorm":
            module.forward = types.MethodType(_gemma_rms_norm_in_input_dtype, module)
        elif name in ("NemotronHForCausalLM", "MambaForCausalLM", "FalconMambaForCausalLM"):
            _logits_in_input_dtype(module)
        elif name == "Gemma4RMSNorm":  # computed in float32 (also without a weight: with_scale=False)
            module.forward = types.MethodType(_gemma4_rms_norm_in_input_dtype, module)
        elif name == "Llama4TextRMSNorm":  # computed in float32
            module.forward = types.MethodType(_llama4_rms_norm_in_input_dtype, module)
        elif name == "Llama4TextL2Norm":  # Llama-4's weightless q/k norm, computed in float32
            module.forward = types.MethodType(_llama4_l2_norm_in_input_dtype, module)
        elif name == "Cohere2LayerNorm":  # a LayerNorm without bias, also computed in float32
            module.forward = types.MethodType(_layer_norm_in_input_dtype, module)
        elif name == "FalconMambaWeightlessRMSNorm":  # Falcon-Mamba's norms of B, C and dt, computed in float32
            module.forward = types.MethodType(_weightless_rms_norm_in_input_dtype, module)
        elif name.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and name != "Qwen3NextRMSNorm":
            module.forward = types.MethodType(_rms_norm_in_input_dtype, module)
    return model


def _configs() -> dict[str, object]:
    """Tiny configs of the plain attention families, which every supported transformers has."""
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=VOCAB, max_position_embeddings=1024)
    return {
        "llama": LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common),
        "qwen3": Qwen3Config(num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, **common),
        "qwen2": Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **common),
        "mistral": MistralConfig(num_key_value_heads=4, sliding_window=None, tie_word_embeddings=False, **common),
    }


def _linear(pattern: str) -> list[str]:
    """Three layers with each kind first and last: A = linear/full/linear, B = full/linear/full."""
    return ["linear_attention", "full_attention", "linear_attention"] if pattern == "A" else [
        "full_attention", "linear_attention", "full_attention"]


def _sliding(pattern: str) -> list[str]:
    return ["sliding_attention", "full_attention", "sliding_attention"] if pattern == "A" else [
        "full_attention", "sliding_attention", "full_attention"]


# tiiuae/Falcon-H1-0.5B's multipliers (its logits are scaled by lm_head_multiplier: a default of 1.0 would hide a
# missing factor).
FALCON_H1_MULTIPLIERS = dict(
    embedding_multiplier=5.656854249492381, lm_head_multiplier=0.0390625, attention_in_multiplier=1.0,
    attention_out_multiplier=0.9375, key_multiplier=0.390625, ssm_in_multiplier=1.25,
    ssm_out_multiplier=0.23570226039551587, mlp_multipliers=[0.8838834764831844, 0.5859375],
    ssm_multipliers=[0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738])


def _arch_configs() -> dict[str, Callable[[], object]]:
    """Tiny configs of the architecture families (hybrid, sliding-window, latent attention), each built on demand
    (`tiny_config`): an older transformers may lack a family's class or validate its fields otherwise.

    Keys are `family` or `family-PATTERN` for mixed-layer models. Windows (16) are shorter than the tested
    prompts; DSA keeps index_topk (24) below the prompt length so the selection is exercised, with 16
    indexer heads so that top-k ties (which would make the selection depend on float noise) do not occur.
    Cohere2 keeps its default logit_scale (0.0625), so a log-prob that missed it would fail every comparison with
    transformers' logits; its layers are in a real model's order (sliding, then a global layer without RoPE).
    Nemotron-H has one block of each kind (Mamba2, attention, MLP, MoE), a stateless block last as in real models;
    at the default initializer_range (0.02) its SSM state is so small beside the mixer's D skip that zeroing it moves
    the log-probs by 7e-7, under the tolerance, so the test model initialises at 0.07 (3.9e-4; larger values push
    transformers' own token-by-token decoding 1e-5 away from its full forward).
    """
    c = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, vocab_size=VOCAB,
             max_position_embeddings=1024)
    moe = dict(moe_intermediate_size=32, num_key_value_heads=4)
    mla = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, head_dim=8)
    out: dict[str, Callable[[], object]] = {
        "mistral-sw": lambda: MistralConfig(num_hidden_layers=2, num_key_value_heads=2, sliding_window=16,
                                            tie_word_embeddings=False, **c),
        "mamba2": lambda: Mamba2Config(hidden_size=64, num_heads=8, head_dim=16, state_size=16, n_groups=1,
                                       conv_kernel=4, chunk_size=16, num_hidden_layers=2, vocab_size=VOCAB, expand=2,
                                       pad_token_id=None, bos_token_id=None, eos_token_id=None),
        "falcon_h1": lambda: FalconH1Config(num_hidden_layers=2, num_key_value_heads=2, mamba_d_ssm=128,
                                            mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
                                            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, pad_token_id=None,
                                            **FALCON_H1_MULTIPLIERS, **c),
        "deepseek_v3": lambda: DeepseekV3Config(num_hidden_layers=2, n_shared_experts=1, n_routed_experts=4,
                                                num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                                q_lora_rank=24, **moe, **mla, **c),
        "glm_moe_dsa": lambda: GlmMoeDsaConfig(num_hidden_layers=2, n_shared_experts=1, n_routed_experts=4,
                                               num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                               q_lora_rank=24, index_topk=24, index_head_dim=16, index_n_heads=16,
                                               indexer_types=["full", "shared"], mlp_layer_types=["dense", "sparse"],
                                               **moe, **mla, **c),
    }
    out["cohere2"] = lambda: Cohere2Config(num_hidden_layers=2, num_key_value_heads=2, sliding_window=16,
                                           layer_types=["sliding_attention", "full_attention"], pad_token_id=None,
                                           bos_token_id=None, eos_token_id=None, **c)
    out["glm4_moe"] = lambda: Glm4MoeConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, n_shared_experts=1,
                                            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                            moe_intermediate_size=32, use_qk_norm=True, attention_bias=True, **c)
    # gpt-oss-20b's values (alternating sliding/full layers starting with a sliding one, window 128 -> 16, YaRN
    # RoPE, swiglu_limit 7, 4 of 32 experts -> 2 of 4, attention and expert biases, head_dim 64 -> 16, 8 KV heads
    # of 64 -> 2 of 4, hidden = intermediate); attention sinks on every layer.
    out["gpt_oss"] = lambda: GptOssConfig(
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
        num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        attention_bias=True, swiglu_limit=7.0, rms_norm_eps=1e-5, router_aux_loss_coef=0.9, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
        max_position_embeddings=131072, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        **{k: v for k, v in c.items() if k not in ("intermediate_size", "max_position_embeddings")})
    # gemma-2-9b's values: sliding/full layers starting with a sliding one (window 4096 -> 16), head_dim 256 =
    # query_pre_attn_scalar -> both 16, attention logits soft-capped at 50 and final logits at 30, GQA 2:1, tied
    # embeddings. Its eager attention (transformers has no sdpa path with soft-capping) takes the softmax in float32.
    out["gemma2"] = lambda: transformers.Gemma2Config(
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, tie_word_embeddings=True, pad_token_id=None,
        bos_token_id=None, eos_token_id=None, **c)
    # granite-3.1-8b's multipliers: logits / 16, embeddings x 12, residual branches x 0.22, attention scale 1/128;
    # GQA 4:1, RoPE theta 1e7, tied embeddings.
    granite = dict(logits_scaling=16.0, embedding_multiplier=12.0, residual_multiplier=0.22,
                   attention_multiplier=0.0078125, rms_norm_eps=1e-5, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0}, pad_token_id=None,
                   bos_token_id=None, eos_token_id=None)
    out["granite"] = lambda: transformers.GraniteConfig(num_hidden_layers=2, num_key_value_heads=1, **granite, **c)
    # granite-3.0-3b-a800m's routing (top 8 of 40 -> 2 of 4) with the same multipliers; GraniteMoeShared adds a
    # shared expert beside the routed ones.
    out["granitemoe"] = lambda: transformers.GraniteMoeConfig(
        num_hidden_layers=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.0, **granite, **c)
    out["granitemoeshared"] = lambda: transformers.GraniteMoeSharedConfig(
        num_hidden_layers=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        shared_intermediate_size=32, router_aux_loss_coef=0.0, **granite, **c)
    # granite-4.0-h-tiny's layout: Mamba2 layers with a NoPE attention layer among them, every layer with a routed MoE
    # (top 6 of 64 -> 2 of 4) beside a shared expert, grouped key/value heads (12:4 -> 4:2), tied embeddings, RMSNorm
    # eps 1e-5; its Mamba2 mixer (conv 4, 1 group, conv bias, no projection bias) shrunk to 8 heads of 16, state 16,
    # chunk 16. The multipliers are granite-4.0-h-350m's (`released.RELEASED`: embeddings x 12, residual branches
    # x 0.246, attention scale 1/64, logits / 3): H-Tiny's own were not found.
    granite_h = dict(logits_scaling=3.0, embedding_multiplier=12.0, residual_multiplier=0.246,
                     attention_multiplier=0.015625, rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=None,
                     bos_token_id=None, eos_token_id=None)
    out["granitemoehybrid"] = lambda: transformers.GraniteMoeHybridConfig(
        num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32, router_aux_loss_coef=0.0,
        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16, mamba_conv_bias=True, mamba_proj_bias=False, position_embedding_type="nope",
        **granite_h, **{k: v for k, v in c.items() if k != "intermediate_size"},
        intermediate_size=32)
    # c4ai-command-r-v01's values: logits x 0.0625, no q/k norm, multi-head attention (64 KV heads of 64), LayerNorm
    # eps 1e-5, RoPE theta 8e6, tied embeddings; attention and MLP in parallel behind one LayerNorm.
    out["cohere"] = lambda: transformers.CohereConfig(
        num_hidden_layers=2, num_key_value_heads=4, logit_scale=0.0625, use_qk_norm=False, layer_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 8_000_000.0}, tie_word_embeddings=True,
        pad_token_id=None, bos_token_id=None, eos_token_id=None, **c)
    out["nemotron_h"] = lambda: NemotronHConfig(
        layers_block_type=["linear_attention", "full_attention", "mlp", "moe"], num_key_value_heads=2, head_dim=16,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1, conv_kernel=4, chunk_size=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
        initializer_range=0.07, pad_token_id=None, bos_token_id=None, eos_token_id=None, **c)
    # Mamba-1 (state-spaces/mamba-130m-hf, tiiuae/falcon-mamba-7b): no projection biases, a conv bias, dt rank
    # ceil(hidden / 16), fp32 residuals, the released time-step init range; Falcon-Mamba's B/C/dt norms (eps 1e-6).
    mamba1 = dict(hidden_size=64, state_size=16, expand=2, conv_kernel=4, num_hidden_layers=2, vocab_size=VOCAB,
                  use_bias=False, use_conv_bias=True, time_step_rank="auto", residual_in_fp32=True,
                  rescale_prenorm_residual=False, layer_norm_epsilon=1e-5, time_step_min=0.001, time_step_max=0.1,
                  time_step_floor=1e-4, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    out["mamba"] = lambda: MambaConfig(tie_word_embeddings=True, **mamba1)
    out["falcon_mamba"] = lambda: FalconMambaConfig(tie_word_embeddings=False, mixer_rms_eps=1e-6, **mamba1)
    # Jamba-v0.1's Mamba layers (d_state 16, d_conv 4, expand 2, dt rank hidden / 16, conv bias, no projection bias),
    # GQA 4:1, top-2 MoE on odd layers; its attention period 8 at offset 4 shrunk to 3 at offset 2: a Mamba layer,
    # a Mamba layer with MoE, a dense attention layer.
    out["jamba"] = lambda: JambaConfig(
        num_hidden_layers=3, num_key_value_heads=1, attn_layer_period=3, attn_layer_offset=2, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank="auto", mamba_conv_bias=True, mamba_proj_bias=False, rms_norm_eps=1e-6,
        tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None, **c)
    # Routed-expert decoders, each with its released checkpoint's routing flags and router_aux_loss_coef, the experts
    # shrunk to 4 (top 2): Qwen3-30B-A3B, Mixtral-8x7B, Qwen1.5-MoE-A2.7B (a shared expert, qkv bias), OLMoE-1B-7B.
    out["qwen3_moe"] = lambda: transformers.Qwen3MoeConfig(
        num_hidden_layers=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        router_aux_loss_coef=0.001, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=False, **c)
    out["mixtral"] = lambda: transformers.MixtralConfig(
        num_hidden_layers=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
        router_aux_loss_coef=0.02, router_jitter_noise=0.0, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False, **c)
    out["qwen2_moe"] = lambda: transformers.Qwen2MoeConfig(
        num_hidden_layers=2, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
        qkv_bias=True, router_aux_loss_coef=0.001, rms_norm_eps=1e-6, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False, **c)
    out["olmoe"] = lambda: transformers.OlmoeConfig(
        num_hidden_layers=2, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        router_aux_loss_coef=0.01, rms_norm_eps=1e-5, clip_qkv=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, tie_word_embeddings=False, pad_token_id=None,
        bos_token_id=None, eos_token_id=None, **c)
    out["qwen3_5_text"] = lambda: Qwen3_5TextConfig(
        num_hidden_layers=3, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, layer_types=_linear("A"), **c)
    for pattern in ("A", "B"):
        out[f"gemma3-{pattern}"] = lambda pattern=pattern: Gemma3TextConfig(
            num_hidden_layers=3, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=16,
            layer_types=_sliding(pattern), **c)
        out[f"qwen3_next-{pattern}"] = lambda pattern=pattern: Qwen3NextConfig(
            num_hidden_layers=3, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            layer_types=_linear(pattern), **c)
        out[f"kimi_linear-{pattern}"] = lambda pattern=pattern: KimiLinearConfig(
            num_hidden_layers=3, num_experts=4, num_experts_per_token=2, num_shared_experts=1, q_lora_rank=None,
            linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, layer_types=_linear(pattern),
            mlp_layer_types=["dense", "sparse", "sparse"], pad_token_id=None, bos_token_id=None, eos_token_id=None,
            **moe, **mla, **c)
    out["gemma3_mm"] = _gemma3_multimodal
    # stablelm-2-1_6b (A: q/k/v biases, sequential residual) and stablelm-2-12b (B: per-head q/k LayerNorm, parallel
    # residual, GQA 4:1): a quarter of each head rotated (partial_rotary_factor 0.25), RoPE theta 1e4, LayerNorm eps
    # 1e-5. Their attention modules call the kernel without the layer's keyword arguments (`engine/hf/active.py`).
    stablelm = dict(num_hidden_layers=2, partial_rotary_factor=0.25, layer_norm_eps=1e-5, hidden_act="silu",
                    tie_word_embeddings=False, **c)
    out["stablelm-A"] = lambda: StableLmConfig(num_key_value_heads=4, use_qkv_bias=True, qk_layernorm=False,
                                               use_parallel_residual=False, **stablelm)
    out["stablelm-B"] = lambda: StableLmConfig(num_key_value_heads=1, use_qkv_bias=False, qk_layernorm=True,
                                               use_parallel_residual=True, **stablelm)
    # Minitron-4B-Base (Nemotron-4): squared-ReLU MLP, LayerNorm1P (eps 1e-5), half of each head rotated, GQA 3:1
    # (-> 2:1 at 4 heads), no biases.
    out["nemotron"] = lambda: NemotronConfig(num_hidden_layers=2, num_key_value_heads=2, head_dim=16,
                                             partial_rotary_factor=0.5, hidden_act="relu2", norm_eps=1e-5,
                                             attention_bias=False, mlp_bias=False, tie_word_embeddings=False, **c)
    # Zamba2: Mamba2 layers and hybrid layers (a shared attention + MLP block over [hidden ; embeddings], then a Mamba2
    # layer); each shared block serves several hybrid layers. A: Zamba2-1.2B (one shared block with per-position LoRA
    # adapters of rank 128 -> 8, RoPE in the shared attention); B: Zamba2-2.7B (two shared blocks alternating, no
    # adapters, no RoPE). Mamba2: d_state 64 -> 16, conv 4, expand 2, one group, chunk 256 -> 16; GELU MLP, eps 1e-5.
    zamba2 = dict(num_key_value_heads=4, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1,
                  n_mamba_heads=8, chunk_size=16, use_conv_bias=True, add_bias_linear=False, hidden_act="gelu",
                  rms_norm_eps=1e-5, tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                  **c)
    out["zamba2-A"] = lambda: Zamba2Config(
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], num_hidden_layers=4, num_mem_blocks=1,
        use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True, **zamba2)
    out["zamba2-B"] = lambda: Zamba2Config(
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid"], num_hidden_layers=5, num_mem_blocks=2,
        use_shared_attention_adapter=False, use_mem_rope=False, **zamba2)
    # Llama-4: chunked attention with RoPE and a weightless q/k L2 norm on 3 of every 4 layers, full attention without
    # RoPE but with position-dependent query temperature (attn_scale 0.1, floor_scale) on the 4th; MoE FFNs (a routed
    # expert with sigmoid gate + a shared expert), GQA 5:1 (-> 4:1). A: Llama-4-Scout-17B-16E (every layer MoE, q/k
    # norm); B: Llama-4-Maverick-17B-128E (MoE on every 2nd layer, dense MLPs between, no q/k norm).
    # attention_chunk_size 8192, floor_scale 8192 and the llama3 RoPE scaling's original_max_position_embeddings 8192
    # shrink to 16, 16, 64.
    llama4 = dict(num_hidden_layers=4, num_key_value_heads=1, head_dim=16, intermediate_size_mlp=128,
                  num_local_experts=4, num_experts_per_tok=1, no_rope_layer_interval=4, attention_chunk_size=16,
                  attn_temperature_tuning=True, floor_scale=16, attn_scale=0.1, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 16.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                   "original_max_position_embeddings": 64}, **c)
    out["llama4-A"] = lambda: Llama4TextConfig(interleave_moe_layer_step=1, use_qk_norm=True, **llama4)
    out["llama4-B"] = lambda: Llama4TextConfig(interleave_moe_layer_step=2, use_qk_norm=False, **llama4)
    # MiniMax-Text-01: lightning (linear) attention layers with one full-attention layer in 8 (-> linear, full,
    # linear), block size 256 -> 16; DeepNorm-style residual scales alpha (2 * 80 layers) ** 0.25, beta 1; GQA 8:1
    # (-> 4:1), RoPE theta 1e7 (its rotary_dim 64 of 128 is not read by transformers' MiniMax, which rotates whole
    # heads); top-2 of 32 experts (-> 4).
    alpha = 3.5565588200778455
    out["minimax"] = lambda: MiniMaxConfig(
        num_hidden_layers=3, layer_types=["linear_attention", "full_attention", "linear_attention"], block_size=16,
        num_key_value_heads=1, head_dim=16, num_local_experts=4, num_experts_per_tok=2, full_attn_alpha_factor=alpha,
        full_attn_beta_factor=1.0, linear_attn_alpha_factor=alpha, linear_attn_beta_factor=1.0, mlp_alpha_factor=alpha,
        mlp_beta_factor=1.0, rms_norm_eps=1e-5, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None,
        eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0}, **c)
    # Gemma-4 text (transformers' Gemma4TextConfig defaults): sliding layers (window 512 -> 16, head_dim 256 -> 16, RoPE
    # theta 1e4) and full layers with their own head dim (global_head_dim 512 -> 32, proportional RoPE over a quarter
    # of it, theta 1e6), last layer full; per-layer input embeddings (256 -> 8); the last layers reuse the K/V of the
    # last earlier layer of their kind (num_kv_shared_layers, 20 of 35 in the E2B model -> 2 of 4) with double-wide
    # MLPs; final-logit soft-capping 30.0.
    out["gemma4"] = lambda: Gemma4TextConfig(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, sliding_window=16, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, use_double_wide_mlp=True,
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", pad_token_id=None,
        bos_token_id=None, eos_token_id=None, **c)
    return out


def _gemma3_multimodal() -> object:
    """gemma-3-4b's composite config (a SigLIP vision tower beside the text decoder, run on text only), sizes shrunk:
    head_dim 256 = query_pre_attn_scalar -> both 16; sliding window 1024 -> 16; the 5 sliding : 1 global pattern ->
    sliding, global, sliding; global layers RoPE theta 1e6 with linear scaling x8, sliding layers theta 1e4
    (rope_local_base_freq); no soft-capping."""
    text = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                query_pre_attn_scalar=16, sliding_window=16, num_hidden_layers=3, layer_types=_sliding("A"),
                vocab_size=VOCAB, max_position_embeddings=1024, rms_norm_eps=1e-6,
                hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None, attn_logit_softcapping=None,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)


ARCH_FAMILIES = tuple(_arch_configs())


# Families whose transformers kernels compute in float32 inside a float64 model
# (tests/engine/state/test_architectures.py says which kernels): a chunked prompt differs from one full pass by
# float32 rounding.
FP32_INSIDE = ("qwen3_next", "qwen3_5_text", "mamba2", "falcon_h1", "kimi_linear", "deepseek_v3", "glm_moe_dsa",
               "cohere2", "glm4_moe", "nemotron_h", "zamba2", "llama4",
               "minimax", "mamba", "falcon_mamba", "jamba",
               "qwen3_moe", "mixtral", "qwen2_moe", "olmoe",
               "gemma2", "cohere", "granitemoehybrid")


def gradient_tolerance(family: str) -> float:
    """Relative gradient error allowed between a replay plan and the plain forward (`standard`) in float64."""
    return FP32_KERNELS_F64 if family.split("-")[0] in FP32_INSIDE else EXACT_F64


def tiny_model(family: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """A random-init model of `family` (llama, qwen3, qwen2, mistral, or one of ARCH_FAMILIES), eval mode,
    params requiring grad. Eager experts for the reference side (grouped_mm has no float64). The calling test is
    skipped, saying why, where this transformers lacks the family or is older than LongStraw needs for it."""
    config = tiny_config(family)
    torch.manual_seed(seed)
    try:  # sdpa keeps the softmax in float64 (eager attention computes it in float32)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", experts_implementation="eager")
    except ValueError:  # Mamba2 has no attention layers, hence no sdpa path
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", experts_implementation="eager")
    model = model.to(dtype).eval()
    for p in model.parameters():
        p.requires_grad_(True)
    if dtype == torch.float64:
        faithful_float64(model)
    return model


# The model type of each family: what LongStraw's per-type transformers minimum is looked up by, known before the
# config is built (Kimi Linear's class exists from transformers 5.17 on).
_MODEL_TYPES = {"gemma3": "gemma3_text", "gemma3_mm": "gemma3", "llama4": "llama4_text", "gemma4": "gemma4_text"}


def tiny_config(family: str) -> object:
    """The tiny config of `family` (llama, qwen3, qwen2, mistral, or one of ARCH_FAMILIES). Skips the calling test,
    saying why, where this transformers has no such model, is older than LongStraw needs for it
    (`architecture.transformers_too_old`), or is not one CI tests the family on (`architecture.on_the_ci_list`);
    nothing skips on the pinned transformers."""
    plain = _configs()
    if family in plain:
        return plain[family]
    base = family.split("-")[0]
    model_type = _MODEL_TYPES.get(base, base)
    if model_type == "kimi_linear" and KimiLinearConfig is None:
        pytest.skip(f"{family}: transformers {transformers.__version__} has no {model_type} model (added in 5.17)")
    why = transformers_too_old(model_type)
    if why is not None:
        pytest.skip(f"{family}: {why}")
    if not on_the_ci_list(model_type):
        pytest.skip(f"{family}: CI tests {model_type} on transformers {CI_TRANSFORMERS}; on "
                    f"{transformers.__version__} LongStraw checks its config instead (tests/models/test_verify.py)")
    return _arch_configs()[family]()


def random_group(prompt_len: int, lengths: list[int], seed: int = 0, dtype=torch.float64, vocab: int = VOCAB,
                 **extra) -> Group:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
    responses = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    advantages = torch.randn(len(lengths), generator=gen, dtype=dtype)
    return Group(prompt=prompt, responses=responses, advantages=advantages, **extra)


def masked(group: Group) -> Group:
    """`group` with loss masks: in each response of 3 or more tokens, the tokens [1, 1 + R//3) are masked, as an
    agent's tool output inside a response would be."""
    masks = []
    for r in group.responses:
        m = torch.ones(r.numel(), dtype=torch.bool)
        if r.numel() >= 3:
            m[1: 1 + r.numel() // 3] = False
        masks.append(m)
    return Group(prompt=group.prompt, responses=group.responses, advantages=group.advantages,
                 old_logprobs=group.old_logprobs, ref_logprobs=group.ref_logprobs, loss_masks=masks)


def with_loss(settings: dict) -> dict:
    """Backward settings with their loss parameters (beta, epsilon_low ...) packed into `loss=LossConfig(...)`, so
    a test parametrised by flat options can pass them to backward_group / backward_tree."""
    from longstraw.engine.loss.config import LossConfig

    names = set(LossConfig.names()) - {"kind"}
    params = {k: v for k, v in settings.items() if k in names}
    if not params:
        return settings
    rest = {k: v for k, v in settings.items() if k not in names}
    loss = rest.pop("loss", "grpo")
    return {**rest, "loss": LossConfig(loss, **params)}


def grads(model: torch.nn.Module) -> torch.Tensor:
    """All parameter gradients flattened into one vector (zeros where a parameter got none)."""
    return torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()
    ])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: b is the reference."""
    return float((a - b).norm() / b.norm())


# Relative tolerances by kernel class: what two computations of the same quantity may differ by.
SAME_ORDER_F64 = 1e-12  # float64, the same operations regrouped (checkpointing, offload, micro-batches, kept graphs)
EXACT_F64 = 1e-10  # float64, another order of the same sums (a replay from the prompt state vs one full forward)
FP32_KERNELS_F64 = 1e-6  # a float64 model whose transformers kernels compute in float32 inside (FP32_INSIDE)
FP32 = 1e-4  # float32, another order of the same sums
FP32_RANKS = 1e-5  # float32, the same sums reduced across ranks (all-reduce, sharded gradients)
FP16 = 5e-3  # a float16 model against the float64 reference
BF16 = 5e-2  # a bfloat16 model against the float64 reference


def assert_close(name: str, ref: torch.Tensor, got: torch.Tensor, rtol: float) -> float:
    """Assert ||got - ref|| / ||ref|| <= rtol, naming the quantity in the failure; returns the relative error."""
    err = rel_err(got, ref)
    assert err <= rtol, f"{name}: relative error {err:.3g} > {rtol:g}"
    return err


TRAIN_WORDS = ("cats", "rain", "maps", "tea", "snow", "bread")


def jsonl_dataset(folder, words: int = 4):
    """A tiny `{"prompt", "answer"}` jsonl dataset for trainer tests: `folder`/data.jsonl."""
    import json
    from pathlib import Path

    path = Path(folder) / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say something about {w}.", "answer": w}) + "\n"
                            for w in TRAIN_WORDS[:words]))
    return path


# Another process holding a run lock: what `train` and `python -m benchmarks compare` must refuse.
_HOLD = ("import sys; from pathlib import Path; from longstraw.train.rundir import RunLock; "
         "lock = RunLock.acquire(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()")


@contextmanager
def held_run_lock(path: Path) -> Iterator[subprocess.Popen]:
    """Another process holding `path`'s run lock until the block ends (its stdin closed: the kernel releases it)."""
    import longstraw

    src = Path(longstraw.__file__).resolve().parents[1]
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=dict(os.environ, PYTHONPATH=str(src)))
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        yield holder
    finally:
        holder.communicate("")
    assert holder.returncode == 0


# Attention kernels: random inputs with a prefix in chunks, and the bf16 check the kernels' tests share.
def attention_inputs(b, h, hkv, t, chunks, d=8, seed=0):
    """Float64 leaves: q (b, h, t, d), own k/v (b, hkv, t, d), prefix chunks (1, hkv, c, d) of `chunks` lengths."""
    gen = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64).requires_grad_(True)  # noqa: E731
    q, k, v = mk(b, h, t, d), mk(b, hkv, t, d), mk(b, hkv, t, d)
    pk = [mk(1, hkv, c, d) for c in chunks]
    pv = [mk(1, hkv, c, d) for c in chunks]
    return q, k, v, pk, pv


def assert_bfloat16_close_to_float64(d: int = 8) -> None:
    """prefix_attention in bf16 against float64 on the same rounded inputs, outputs and every gradient: within bf16
    rounding, because merges and log-sum-exps run in fp32 (the portable and fused kernels' tests share it)."""
    q, k, v, pk, pv = attention_inputs(2, 4, 2, 9, [5, 7, 3], d=d)
    low = [t.detach().to(torch.bfloat16).requires_grad_(True) for t in (q, k, v, *pk, *pv)]
    ref_in = [t.detach().double().requires_grad_(True) for t in low]

    def run(ts):
        out = prefix_attention(ts[0], ts[1], ts[2], list(ts[3:6]), list(ts[6:9]), 0.35)
        weight = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
        return out, torch.autograd.grad((out.double() * weight).sum(), ts)

    (out_low, g_low), (out_ref, g_ref) = run(low), run(ref_in)
    assert out_low.dtype == torch.bfloat16
    assert (out_low.double() - out_ref).norm() / out_ref.norm() < 1e-2
    for a, r in zip(g_low, g_ref):
        assert (a.double() - r).norm() / r.norm() < 3e-2


# Multi-process tests: ranks started by hand with torch.distributed's environment (gloo on 127.0.0.1).
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(args: list[str], world: int, timeout: float = 300.0, cwd: Path | None = None,
              paths: list[Path] | None = None, env: dict[str, str] | None = None) -> list[tuple[int, str]]:
    """Run `python <args>` as `world` ranks (torch.distributed's environment, a free port on 127.0.0.1); return
    (exit code, stdout+stderr) per rank. `paths`: the children's PYTHONPATH; `env`: more variables. Kills all on
    timeout."""
    port = free_port()
    procs = []
    for rank in range(world):
        variables = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                         LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                         OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(str(p) for p in paths or []), **(env or {}))
        variables.pop("TORCHELASTIC_RUN_ID", None)
        procs.append(subprocess.Popen([sys.executable, *args], env=variables, cwd=cwd, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            results.append((p.returncode, out))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail(f"ranks did not finish within {timeout} s (a hang); their output:\n" + "\n---\n".join(outs))
    return results


def assert_ranks_ok(ranks: list[tuple[int, str]]) -> None:
    """Every rank exited 0; else the tail of every failed rank's output (the first failure is often another's)."""
    failed = [f"rank {i} exited {code}:\n{output[-3000:]}" for i, (code, output) in enumerate(ranks) if code != 0]
    assert not failed, "\n---\n".join(failed)


def child_pids(pid: int) -> list[int]:
    """The direct children of process `pid` (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def running(pid: int) -> bool:
    """Alive and not a zombie (Linux /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- prefix trees (tests/engine/tree, tests/distributed) ------------------------------------------------------
class TokenRuns:
    """Random token runs from one seeded generator."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, n: int) -> torch.Tensor:
        return torch.randint(0, 512, (n,), generator=self.gen)


def two_task_tree() -> list[Trajectory]:
    """One prompt shared by two tasks' groups (depth 2: system prompt, task, answers); uneven groups."""
    r = TokenRuns(1)
    system, task_a, task_b = r(19), r(7), r(5)
    out = [Trajectory(torch.cat([system, task_a, r(n)]), 26, a, group=0) for n, a in ((4, 1.0), (6, -0.5), (1, 0.3))]
    out += [Trajectory(torch.cat([system, task_b, r(n)]), 24, a, group=1) for n, a in ((3, 0.7), (5, -0.7))]
    return out


def agent_tree() -> list[Trajectory]:
    """An agent tree with root-to-leaf paths of 2, 3 and 4 nodes and every case at once: a shared first turn
    (response tokens in the loss of four trajectories with different advantages), a masked observation, a one-token
    node (`y`), uneven branching, a trajectory that is a prefix of others (successive turns of one conversation), two
    groups."""
    r = TokenRuns(3)
    system, task, turn, obs, y = r(17), r(9), r(5), r(4), r(1)
    start = 26  # the first turn is the policy's
    out = []
    for tail, adv in ((r(3), 1.0), (r(4), -0.5)):
        ids = torch.cat([system, task, turn, obs, tail])
        mask = torch.ones(ids.numel() - start, dtype=torch.bool)
        mask[5:9] = False  # the observation
        out.append(Trajectory(ids, start, adv, loss_mask=mask))
    out.append(Trajectory(torch.cat([system, task, turn, r(6)]), start, 0.3))
    out.append(Trajectory(torch.cat([system, task, turn]), start, -0.8))  # earlier turn of the ones above
    out.append(Trajectory(torch.cat([system, task, turn, y, r(3)]), start, 0.4))
    out.append(Trajectory(torch.cat([system, task, turn, y, r(2)]), start, -0.9))
    other = r(6)
    out += [Trajectory(torch.cat([system, other, r(n)]), 23, a, group=1) for n, a in ((7, 0.7), (2, -0.7))]
    return out
