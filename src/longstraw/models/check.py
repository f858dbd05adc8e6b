"""`longstraw check`: the admission check of one model's config, or of every causal-LM type of this transformers.

Building the parser imports neither torch nor transformers (`longstraw --help` stays fast): the check imports them
when it runs.

`longstraw check MODEL` (a hub id, a directory, a config.json, a .gguf file or a preset) prints `verify`'s numbers
and the verdict; exit status 0 when admitted, 1 when refused. `longstraw check --all --out FILE.json --markdown
FILE.md` runs every type of transformers' causal-LM mapping from its class defaults (with a released checkpoint's
multipliers where `RELEASED` has them) and writes the results and the table docs/architectures.md includes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

# Values of a released checkpoint's config that differ from its class defaults and change the computation
# (multipliers, logit factors, soft-caps, router settings, rotary fractions and bases, layer patterns, head grouping):
# the sweep's configs keep them, so a default of 1.0 cannot hide a factor. Sizes (width, depth, vocabulary, experts)
# are left out: `verify.tiny_config` shrinks them anyway. Each entry names its checkpoint in `RELEASED_CHECKPOINT`;
# the comment names where its config.json was read (the hub itself is not reachable from the machines that wrote
# this table).
_GEMMA3_TEXT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0}}
# DeepSeek-V3 / V3.2's YaRN (factor 40 over 4096 positions; mscale 1 scales the softmax by (0.1 ln 40 + 1)^2).
_DEEPSEEK_V3_YARN = {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
_QWEN3_5_MOE_TEXT = {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                                         "partial_rotary_factor": 0.25, "mrope_interleaved": True,
                                         "mrope_section": [11, 11, 10]}}
RELEASED: dict[str, dict[str, Any]] = {
    # https://huggingface.co/ibm-granite/granite-3.3-8b-instruct/blob/main/config.json (a public dump of it:
    # multipliers, RoPE theta 1e7, GQA 32:8, tied embeddings, eps 1e-5)
    "granite": {"logits_scaling": 16.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.0078125, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                "num_attention_heads": 32, "num_key_value_heads": 8,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0}},
    # ibm-granite/granite-3.1-1b-a400m's config.json (a full copy in a public benchmark's model presets; the same
    # multipliers appear in two ports' Granite-MoE test configs): embedding x 12, residual x 0.22, attention scale 1/64,
    # logits / 6, RoPE theta 1.5e6, GQA 16:8, tied embeddings, eps 1e-6. No copy of granite-3.1-3b-a800m's
    # multipliers was found.
    "granitemoe": {"logits_scaling": 6.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                   "attention_multiplier": 0.015625, "tie_word_embeddings": True, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "rms_norm_eps": 1e-6,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1_500_000.0}},
    # granite-3.1-1b-a400m's multipliers on the shared-expert class (no released config of a shared-expert
    # checkpoint was found)
    "granitemoeshared": {"logits_scaling": 6.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                         "attention_multiplier": 0.015625},
    # https://huggingface.co/ibm-granite/granite-4.0-h-350m/blob/main/config.json (as quoted by an MLX port's test
    # fixture): the multipliers (embedding 12, residual 0.246, attention 1/64, logits / 3), Mamba2 layers with four
    # NoPE attention layers among 32, GQA 12:4, tied embeddings, a dense shared MLP (no routed experts). The routed
    # Granite-4.0-H checkpoints' (H-Tiny, H-Small) multipliers were not found.
    "granitemoehybrid": {"logits_scaling": 3.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.246,
                         "attention_multiplier": 0.015625, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                         "num_attention_heads": 12, "num_key_value_heads": 4, "position_embedding_type": "nope",
                         "num_local_experts": 0, "num_experts_per_tok": 0, "mamba_n_groups": 1,
                         "mamba_conv_bias": True, "mamba_proj_bias": False, "num_hidden_layers": 32,
                         "layer_types": ["attention" if i in (10, 13, 17, 27) else "mamba" for i in range(32)]},
    # CohereForAI/c4ai-command-r-v01's config.json (as public ports' tests quote it): logits x 0.0625 (the class
    # default), RoPE theta 8e6, multi-head attention, tied embeddings
    "cohere": {"logit_scale": 0.0625, "rope_parameters": {"rope_type": "default", "rope_theta": 8_000_000.0}},
    # https://huggingface.co/google/gemma-3-27b-it/blob/main/config.json's text_config (AI-Hypercomputer/maxtext,
    # src/maxtext/checkpoint_conversion/utils/hf_model_configs.py): queries scaled by 168^-1/2 with head_dim 128,
    # global layers' RoPE linearly scaled x8, GQA 2:1, no soft-capping.
    "gemma3_text": {"query_pre_attn_scalar": 168, "num_attention_heads": 32, "num_key_value_heads": 16,
                    "final_logit_softcapping": None, "attn_logit_softcapping": None,
                    "rope_parameters": _GEMMA3_TEXT_ROPE},
    # https://huggingface.co/google/gemma-3-4b-it/blob/main/config.json (same source): the global layers' linear
    # RoPE scaling x8; the rest of its text_config is the class defaults.
    "gemma3": {"text_config": {"rope_parameters": _GEMMA3_TEXT_ROPE, "final_logit_softcapping": None,
                               "attn_logit_softcapping": None}},
    # https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json (same source): the class defaults are
    # gpt-oss-20b's but for the router's auxiliary-loss coefficient.
    "gpt_oss": {"router_aux_loss_coef": 0.9},
    # https://huggingface.co/Qwen/Qwen3-30B-A3B-Base/blob/main/config.json (same source; its class defaults do not
    # normalise the top-k weights)
    "qwen3_moe": {"norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    # https://huggingface.co/mistralai/Mixtral-8x7B-Instruct-v0.1/blob/main/config.json (same source)
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.02},
    # Qwen/Qwen1.5-MoE-A2.7B(-Chat): experts, top-k and the shared expert's width as a public planner fixture quotes
    # its config.json (norm_topk_prob, not in that copy, is not re-read)
    "qwen2_moe": {"num_experts": 60, "num_experts_per_tok": 4, "norm_topk_prob": False,
                  "shared_expert_intermediate_size": 5632},
    # microsoft/Phi-4-mini-instruct, as a public planner fixture quotes its config.json (without its LongRoPE factor
    # lists, which are sized by the head dim)
    "phi3": {"partial_rotary_factor": 0.75, "tie_word_embeddings": True, "num_attention_heads": 24,
             "num_key_value_heads": 8},
    # bigcode/starcoder2-7b's config.json (an inference engine's test copy of it, cut to 6 layers; NeMo's
    # Starcoder2Config7B agrees): biases, tanh GELU, LayerNorm eps 1e-5, every layer windowed (4096), GQA 36:4,
    # RoPE theta 1e6
    "starcoder2": {"use_bias": True, "hidden_act": "gelu_pytorch_tanh", "norm_epsilon": 1e-5, "sliding_window": 4096,
                   "num_attention_heads": 36, "num_key_value_heads": 4,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    # https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json (same source; its class defaults have
    # no routed experts): YaRN x40 with mscale 0.707, which scales the softmax.
    "deepseek_v2": {"n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1,
                    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "moe_intermediate_size": 1408,
                    "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                    "v_head_dim": 128, "routed_scaling_factor": 1.0,
                    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0,
                                        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707,
                                        "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}},
    # https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (same source)
    "deepseek_v3": {"rope_parameters": _DEEPSEEK_V3_YARN},
    # https://huggingface.co/deepseek-ai/DeepSeek-V3.2/blob/main/config.json (same source)
    "deepseek_v32": {"rope_parameters": _DEEPSEEK_V3_YARN},
    # Qwen/Qwen3-Next-80B-A3B's config.json (same source): RoPE theta 1e7
    "qwen3_next": {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                                       "partial_rotary_factor": 0.25}},
    # https://huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/config.json's text_config (same source): RoPE theta 1e7,
    # interleaved M-RoPE sections (equal to 1-D RoPE on text)
    "qwen3_5_moe_text": _QWEN3_5_MOE_TEXT,
    "qwen3_5_moe": {"text_config": _QWEN3_5_MOE_TEXT},
    # allenai/Olmo-3-1025-7B's config.json (same source, which lists the 7B base and instruct together): RMSNorm
    # eps 1e-6
    "olmo3": {"rms_norm_eps": 1e-6},
    # https://huggingface.co/allenai/OLMo-2-1124-7B/blob/main/config.json (a public dump of it; also mirrored in
    # Megatron-Bridge's OLMo-2 tests): RMSNorm eps 1e-6, RoPE theta 5e5
    "olmo2": {"rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}},
    # https://huggingface.co/HuggingFaceTB/SmolLM3-3B/blob/main/config.json (as quoted by public ports' fixtures):
    # RoPE theta 5e6 (on three of every four layers, the class default pattern)
    "smollm3": {"rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0}},
    # tiiuae/Falcon-H1-0.5B's config.json (NVIDIA-NeMo/Megatron-Bridge,
    # tests/unit_tests/models/falcon_h1/test_falcon_h1_bridge.py FALCON_H1_500M_CONFIG): the muP multipliers, RoPE
    # theta 1e11, GQA 8:2, the Mamba2 gate applied after the norm
    "falcon_h1": {"embedding_multiplier": 5.656854249492381, "lm_head_multiplier": 0.0390625,
                  "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.9375,
                  "key_multiplier": 0.39062499999999994,
                  "ssm_in_multiplier": 1.25, "ssm_out_multiplier": 0.23570226039551587,
                  "mlp_multipliers": [0.8838834764831844, 0.5859375],
                  "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
                  "mamba_norm_before_gate": False, "rms_norm_eps": 1e-5,
                  "num_attention_heads": 8, "num_key_value_heads": 2,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e11}},
    # zai-org/GLM-4.5's config.json (NVIDIA-NeMo/Megatron-Bridge, tests/unit_tests/models/glm/test_glm45_bridge.py
    # glm45_355b_config): q/k/v biases and a per-head q/k norm, routed weights x 2.5, three dense layers first, RoPE
    # theta 1e6 over half of each head, RMSNorm eps 1e-6
    "glm4_moe": {"attention_bias": True, "use_qk_norm": True, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
                 "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0,
                                                           "partial_rotary_factor": 0.5}},
    # LGAI-EXAONE/EXAONE-4.0-1.2B's config.json (NVIDIA-NeMo/Megatron-Bridge,
    # tests/unit_tests/models/exaone/test_exaone4_bridge.py make_exaone4_config): Llama-3 RoPE scaling x16 over 8192
    # positions at theta 1e6, GQA 32:8, tied embeddings. That copy omits the window fields, so the layer pattern is
    # the class default's (three sliding layers, then a global one).
    "exaone4": {"num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
                "rope_parameters": {"rope_type": "llama3", "rope_theta": 1_000_000.0, "factor": 16.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}},
    # CohereLabs/tiny-aya-global's config.json (as quoted, four of its layers, by an MLX Swift port's test): logits
    # not scaled (logit_scale 1.0; Command-R7B-style checkpoints scale them), GQA 16:4, RoPE theta 5e4, three
    # sliding-window layers then a global one
    "cohere2": {"logit_scale": 1.0, "num_attention_heads": 16, "num_key_value_heads": 4, "layer_norm_eps": 1e-5,
                "rope_parameters": {"rope_type": "default", "rope_theta": 50_000.0}},
    # ByteDance-Seed/Seed-OSS-36B-Instruct's config.json (as quoted by MLX Swift ports' tests): RoPE theta 1e7
    "seed_oss": {"rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0}},
    # tencent/Hunyuan-7B-Instruct's config.json (a public dump of it): NTK-alpha RoPE (alpha 1000, labelled
    # "dynamic"), GQA 32:8, tied embeddings
    "hunyuan_v1_dense": {"num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
                         "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10_000.0, "alpha": 1000.0,
                                             "factor": 1.0}},
    # microsoft/bitnet-b1.58-2B-4T's config.json (as quoted in a public model card's "Model Architecture"): the class
    # defaults but for tied embeddings
    "bitnet": {"tie_word_embeddings": True},
    # swiss-ai/Apertus-8B-Instruct-2509's config.json (as quoted by public MLX ports' tests): the class defaults (xIELU,
    # q/k norm, Llama-3 RoPE x8 at theta 1.2e7) but for GQA 32:8
    "apertus": {"num_attention_heads": 32, "num_key_value_heads": 8},
    # zai-org/GLM-4-9B-0414's config.json (the values a public fine-tuning script checks it against): the class
    # defaults (GQA 32:2, q/k/v biases, half of each head rotated) but for RMSNorm eps 1e-5
    "glm4": {"rms_norm_eps": 1e-5},
    # zai-org/GLM-4.7-Flash's config.json (as vLLM's and public ports' tests quote it): the class defaults but for
    # RoPE theta 1e6
    "glm4_moe_lite": {"rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    # ibm-ai-platform/Bamba-9B's config.json (as a public architecture classifier's test quotes it, trimmed):
    # attention layers at 9, 18 and 27 of 32 Mamba2 layers (the class defaults have none)
    "bamba": {"num_hidden_layers": 32, "attn_layer_indices": [9, 18, 27]},
    # rednote-hilab/dots.llm1.inst's config.json (as an MLX port's test quotes its mlx-community quantized copy,
    # trimmed; n_group / topk_group are null there: no grouped routing): 128 experts top-6 with 2 shared, weights
    # normalised and x 2.5, one dense layer first, multi-head attention, RoPE theta 1e7, RMSNorm eps 1e-5 (its class
    # defaults have no routed experts)
    "dots1": {"n_routed_experts": 128, "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1,
              "norm_topk_prob": True, "routed_scaling_factor": 2.5, "moe_intermediate_size": 1408, "n_group": 1,
              "topk_group": 1, "rms_norm_eps": 1e-5, "num_attention_heads": 32, "num_key_value_heads": 32,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0}},
    # LiquidAI/LFM2-1.2B: attention at layers 2, 5, 8, 10, 12, 14 of 16, short convolutions elsewhere (as public
    # ports' tests quote its config.json's full_attn_idxs; the class defaults have no short-conv layers)
    "lfm2": {"num_hidden_layers": 16, "layer_types": [
        "full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)]},
    # https://huggingface.co/microsoft/phi-2/blob/main/config.json (a public dump of it): a fifth of each head rotated
    "phi": {"partial_rotary_factor": 0.4, "hidden_act": "gelu_new", "layer_norm_eps": 1e-5},
    # nvidia/Minitron-4B-Base's config.json (Nemotron-4; NVIDIA-NeMo/Megatron-Bridge,
    # tests/unit_tests/models/nemotron/test_nemotron_bridge.py nemotron_config_dict, whose sizes are Minitron-4B's:
    # hidden 3072, GQA 24:8, half of each head rotated, relu2, eps 1e-5; its class defaults leave the key/value
    # heads unset)
    "nemotron": {"num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5, "hidden_act": "relu2",
                 "norm_eps": 1e-5},
    # EleutherAI/pythia-1b (the class defaults' values)
    "gpt_neox": {"rotary_pct": 0.25, "use_parallel_residual": True, "hidden_act": "gelu"},
    # microsoft/Phi-3.5-MoE-instruct's config.json (listed field by field in a public fine-tuning write-up): q/k/v/o
    # and LM-head biases, RoPE theta 1e4 (the class default is 1e6), a window as long as the context, no router
    # auxiliary loss. Its LongRoPE factor lists (sized by the head dim, not in that copy) are left out: plain RoPE.
    "phimoe": {"attention_bias": True, "lm_head_bias": True, "sliding_window": 131072, "router_aux_loss_coef": 0.0,
               "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0}},
    # MiniMaxAI/MiniMax-M2's config.json (as public ports' tests quote it: rotary_dim 64 of head_dim 128, RoPE theta
    # 5e6, GQA 48:8, eps 1e-6): half of each head rotated (the class defaults rotate all of it)
    "minimax_m2": {"rope_parameters": {"rope_type": "default", "rope_theta": 5_000_000.0,
                                       "partial_rotary_factor": 0.5}},
    # nvidia/Nemotron-H-8B-Base-8K's config.json (NVIDIA-NeMo/Megatron-Bridge,
    # tests/unit_tests/models/nemotronh/test_nemotron_h_bridge.py nemotronh_8b_config_dict): the layer pattern
    # M-M-M-M*-M-M-M-M-M*-... of 52 (Mamba2, MLP, attention; no MoE layers, which the class defaults have); every
    # other value that changes the computation is the class defaults'
    "nemotron_h": {"layer_types": [
        {"M": "mamba", "-": "mlp", "*": "attention"}[c]
        for c in "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"]},
    # mistralai/Ministral-8B-Instruct-2410's config.json (a full copy, saved as model_type mistral by transformers
    # 4.46, in a public kernel benchmark suite): RoPE theta 1e8, RMSNorm eps 1e-5, every layer windowed (32768),
    # GQA 32:8
    "ministral": {"rms_norm_eps": 1e-5, "sliding_window": 32768, "num_attention_heads": 32, "num_key_value_heads": 8,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 100_000_000.0}},
    # google/gemma-2b's config.json (NVIDIA-NeMo/Megatron-Bridge, tests/unit_tests/models/gemma/test_gemma_bridge.py
    # gemma_2b_config_dict): one key/value head for 8 query heads of 256; its "hidden_act": "gelu" is the legacy
    # spelling GemmaConfig turns into the tanh GELU (the default). gemma-7b's config there is the class defaults.
    "gemma": {"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256},
    # tencent/Hunyuan-A13B-Instruct's config.json (remote-code spelling, quoted by an MLX Swift port's test
    # fixture): NTK-alpha RoPE (alpha 1000, labelled "dynamic"), GQA 32:8, tied embeddings, 64 experts top-8 beside
    # one shared MLP of the experts' width (3072), q/k norm (the class always has both)
    "hunyuan_v1_moe": {"num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
                       "num_experts": 64, "num_experts_per_tok": 8,
                       "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10_000.0, "alpha": 1000.0,
                                           "factor": 1.0}},
    # allenai/Olmo-Hybrid-7B: no RoPE on any layer (its config.json's rope_parameters is {"rope_theta": null}, as a
    # public port's parity test describes the release after reading its checkpoint; no copy of the file itself was
    # found). The rest that port names (3 Gated DeltaNet layers in 4, eps 1e-6, negative eigenvalues allowed) is the
    # class defaults.
    "olmo_hybrid": {"rope_parameters": {"rope_theta": None}},
}
# The checkpoint each `RELEASED` entry is read from (docs/architecture-verdicts.md names it per type).
RELEASED_CHECKPOINT: dict[str, str] = {
    "granite": "ibm-granite/granite-3.3-8b-instruct",
    "granitemoe": "ibm-granite/granite-3.1-1b-a400m",
    "granitemoeshared": "ibm-granite/granite-3.1-1b-a400m (its multipliers on the shared-expert class)",
    "granitemoehybrid": "ibm-granite/granite-4.0-h-350m",
    "cohere": "CohereForAI/c4ai-command-r-v01",
    "gemma3_text": "google/gemma-3-27b-it",
    "gemma3": "google/gemma-3-4b-it",
    "gpt_oss": "openai/gpt-oss-20b",
    "qwen3_moe": "Qwen/Qwen3-30B-A3B-Base",
    "mixtral": "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "qwen2_moe": "Qwen/Qwen1.5-MoE-A2.7B",
    "phi3": "microsoft/Phi-4-mini-instruct",
    "starcoder2": "bigcode/starcoder2-7b",
    "deepseek_v2": "deepseek-ai/DeepSeek-V2-Lite",
    "deepseek_v3": "deepseek-ai/DeepSeek-V3",
    "deepseek_v32": "deepseek-ai/DeepSeek-V3.2",
    "qwen3_next": "Qwen/Qwen3-Next-80B-A3B",
    "qwen3_5_moe_text": "Qwen/Qwen3.5-35B-A3B",
    "qwen3_5_moe": "Qwen/Qwen3.5-35B-A3B",
    "olmo3": "allenai/Olmo-3-1025-7B",
    "olmo2": "allenai/OLMo-2-1124-7B",
    "smollm3": "HuggingFaceTB/SmolLM3-3B",
    "falcon_h1": "tiiuae/Falcon-H1-0.5B",
    "glm4_moe": "zai-org/GLM-4.5",
    "exaone4": "LGAI-EXAONE/EXAONE-4.0-1.2B",
    "cohere2": "CohereLabs/tiny-aya-global",
    "seed_oss": "ByteDance-Seed/Seed-OSS-36B-Instruct",
    "hunyuan_v1_dense": "tencent/Hunyuan-7B-Instruct",
    "bitnet": "microsoft/bitnet-b1.58-2B-4T",
    "apertus": "swiss-ai/Apertus-8B-Instruct-2509",
    "glm4": "zai-org/GLM-4-9B-0414",
    "glm4_moe_lite": "zai-org/GLM-4.7-Flash",
    "bamba": "ibm-ai-platform/Bamba-9B",
    "dots1": "rednote-hilab/dots.llm1.inst",
    "lfm2": "LiquidAI/LFM2-1.2B",
    "phi": "microsoft/phi-2",
    "nemotron": "nvidia/Minitron-4B-Base",
    "gpt_neox": "EleutherAI/pythia-1b",
    "phimoe": "microsoft/Phi-3.5-MoE-instruct",
    "minimax_m2": "MiniMaxAI/MiniMax-M2",
    "nemotron_h": "nvidia/Nemotron-H-8B-Base-8K",
    "ministral": "mistralai/Ministral-8B-Instruct-2410",
    "gemma": "google/gemma-2b",
    "hunyuan_v1_moe": "tencent/Hunyuan-A13B-Instruct",
    "olmo_hybrid": "allenai/Olmo-Hybrid-7B",
}
# Types whose class defaults were checked against a released config.json and found to hold every value that changes
# the computation (model type -> the checkpoint, and where its config was read).
RELEASED_EQUALS_DEFAULTS: dict[str, str] = {
    # every computation-changing value of its config equals JambaConfig's defaults (its mamba_dt_rank 256 is the
    # default "auto", hidden / 16)
    "jamba": "ai21labs/AI21-Jamba-1.5-Mini (config.json quoted in sdpython's onnx model helpers)",
    # soft-caps 50 (attention) and 30 (logits), queries scaled by 256^-1/2, GQA 2:1, window 4096: Gemma2Config's
    # defaults
    "gemma2": "google/gemma-2-2b-it (config.json quoted in a public profiling script)",
    # GQA 16:2 with head_dim 128, RoPE theta 5e5, tied embeddings, no biases: Ernie4_5Config's defaults
    "ernie4_5": "baidu/ERNIE-4.5-0.3B-PT (a public copy of its config.json)",
    # GQA-free 20 heads, RMSNorm eps 1e-8, RoPE theta 1e5, untied: HeliumConfig's defaults
    "helium": "kyutai/helium-1-preview-2b (config.json quoted field for field by an MLX port's test)",
    "olmoe": "allenai/OLMoE-1B-7B-0924 (NVIDIA-NeMo/Megatron-Bridge, "
             "tests/unit_tests/models/olmoe/test_olmoe_bridge.py)",
    # GQA 20:4 with head_dim 128, RoPE theta 5e5, eps 1e-5, tied embeddings, no biases, 64 experts top-6 with 2 shared,
    # experts on layers 1-27: Ernie4_5_MoeConfig's defaults
    "ernie4_5_moe": "baidu/ERNIE-4.5-21B-A3B-PT (config.json quoted by an MLX Swift port's test and a planner fixture)",
    # GQA 32:2 with head_dim 128, q/k/v biases, half of each head rotated at theta 1e4, RMSNorm eps 1.5625e-7,
    # untied: GlmConfig's defaults
    "glm": "THUDM/glm-4-9b-chat-hf (config.json quoted as golden values by public ports' tests)",
}
# Types of the families on the CI list whose released config.json was looked for and not found here: their sweep
# runs on the class defaults.
RELEASED_NOT_FOUND: tuple[str, ...] = (
    # no copy of arcee-ai/AFM-4.5B's config.json was found (only test-sized ones)
    "arcee",
)


def released_source(model_type: str) -> str:
    """Where the sweep's config of `model_type` comes from, for the table: a released checkpoint's values, the class
    defaults checked equal to one, or the class defaults."""
    if model_type in RELEASED:
        return f"values of {RELEASED_CHECKPOINT[model_type]}"
    if model_type in RELEASED_EQUALS_DEFAULTS:
        return f"class defaults, checked equal to {RELEASED_EQUALS_DEFAULTS[model_type].split(' (')[0]}"
    if model_type in RELEASED_NOT_FOUND:
        return "class defaults: no released config found"
    return "class defaults"


# Types of the causal-LM mapping that are not decoder-only text models: encoders with a causal-LM head, the decoders of
# encoder-decoder models, XLNet's permutation LM, and speech, music and image-captioning decoders. Listed in the table,
# outside the count.
NOT_DECODER_ONLY_TEXT = (
    "bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "blenderbot", "blenderbot-small", "camembert",
    "data2vec-text", "electra", "ernie", "git", "marian", "mbart", "megatron-bert", "moshi", "moss_transcribe_diarize",
    "musicgen", "musicgen_melody", "mvp", "pegasus", "plbart", "prophetnet", "rembert", "roberta",
    "roberta-prelayernorm", "roc_bert", "roformer", "trocr", "whisper", "xlm", "xlm-roberta", "xlm-roberta-xl",
    "xlnet", "xmod",
)


def causal_lm_types() -> list[str]:
    """Every model type of this transformers' causal-LM mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sweep_config(model_type: str) -> Any:
    """The config a user's causal LM of `model_type` holds: the class defaults with `RELEASED`'s values, and for a
    composite type whose causal-LM class is its text model (Qwen3.5, Llama-4, Mllama), that text model's config."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(model_type, **RELEASED.get(model_type, {}))
    if getattr(config, "text_config", None) is None:
        return config
    try:
        with torch.device("meta"):
            built = transformers.AutoModelForCausalLM.from_config(config).config
    except Exception:  # the class cannot be built here (a missing optional dependency): check the config as given
        return config
    return built


class _Refused(Exception):
    """A type refused for a known missing mechanism (`REFUSED_MODEL_TYPES`), without a check."""


def with_planner(verdict: Any, config: Any) -> Any:
    """`verdict` with the planner's formula for its prompt state (`planner_bytes`; None where the planner does not
    describe the family)."""
    import dataclasses

    from longstraw import planner
    from longstraw.models import verify

    try:
        tiny, _ = verify.tiny_config(config)
        spec = planner.spec_from_config(tiny, verdict.model_type)
        formula = planner.state_bytes(spec, 40, 8, 16, exact=True)[0]
    except Exception:  # the planner has no formula for this family's layers
        formula = None
    return dataclasses.replace(verdict, planner_bytes=formula)


def _row(model_type: str) -> dict[str, Any]:
    from longstraw.models import verify
    from longstraw.models.architecture import REFUSED_MODEL_TYPES

    started = time.perf_counter()
    try:
        if model_type in REFUSED_MODEL_TYPES:
            raise _Refused(REFUSED_MODEL_TYPES[model_type])
        config = sweep_config(model_type)
        verdict = with_planner(verify.verify(config), config)
        row = dict(dataclasses.asdict(verdict), model_type=model_type, config_model_type=verdict.model_type)
    except _Refused as err:
        row = {"model_type": model_type, "kind": "refused", "reason": f"refused: {err}"}
    except Exception as err:  # the config class itself cannot be built from its defaults
        row = {"model_type": model_type, "kind": "refused",
               "reason": f"its default config cannot be built: {type(err).__name__}: {str(err)[:200]}"}
    row["decoder_only_text"] = model_type not in NOT_DECODER_ONLY_TEXT
    row["values"] = released_source(model_type)
    row["seconds"] = round(time.perf_counter() - started, 2)
    return row


def _short(row: dict[str, Any]) -> str:
    """The table's 'why' cell: the measured difference, the crash, or the first layer that differs."""
    if row["kind"] != "refused":
        worst = max((row.get(k) or 0.0) for k in ("logprob_error", "gradient_error", "sampled_error"))
        return f"max error {worst:.1e} (tolerance {row.get('tolerance', 0):g})"
    if str(row.get("reason", "")).startswith(("the check crashed", "refused:", "no tiny copy", "its default")):
        return str(row["reason"]).replace("|", "/")[:240]
    parts = []
    for name, key in (("log-probs", "logprob_error"), ("gradient", "gradient_error"), ("sampled", "sampled_error")):
        value = row.get(key)
        if value is not None and value > row.get("tolerance", 0):
            parts.append(f"{name} off by {value:.2g}")
    if row.get("first_difference"):
        parts.append(f"first differs at {row['first_difference']}")
    if row.get("reason") and not parts:
        parts.append(row["reason"])
    return "; ".join(parts).replace("|", "/")[:240]


def markdown(rows: list[dict[str, Any]], source: str) -> str:
    """The table of every type: verdict and why, decoder-only text types first."""
    import transformers

    decoders = [r for r in rows if r["decoder_only_text"]]
    admitted = [r for r in decoders if r["kind"] != "refused"]
    lines = [
        f"Written by `longstraw check --all` ({source}); transformers {transformers.__version__}. "
        f"{len(admitted)} of {len(decoders)} decoder-only text types admitted "
        f"({sum(r['kind'] == 'exact' for r in admitted)} exact in float64, "
        f"{sum(r['kind'] != 'exact' for r in admitted)} exact within float32 kernels).",
        "",
        "The config column says whose values the check's config holds: a released checkpoint's (`RELEASED` in "
        "models/check.py), the class defaults checked equal to a released config, or the class defaults.",
        "",
        "| model type | verdict | measured / why | config |",
        "|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (not r["decoder_only_text"], r["model_type"])):
        kind = r["kind"] if r["decoder_only_text"] else f"{r['kind']} (not a decoder-only text model)"
        values = r.get("values") or released_source(r["model_type"])
        lines.append(f"| `{r['model_type']}` | {kind} | {_short(r)} | {values} |")
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from longstraw.choices import PRESET_NAMES

    parser.add_argument("model", nargs="?", help="a hub id, a directory or config.json, a .gguf file or a preset "
                                                 f"({', '.join(PRESET_NAMES)})")
    parser.add_argument("--all", action="store_true",
                        help="check every causal-LM type of this transformers (its class defaults, with a released "
                             "checkpoint's multipliers where known)")
    parser.add_argument("--only", default=None, help="with --all: comma-separated model types to check")
    parser.add_argument("--out", default=None, help="write the verdicts as JSON to this file")
    parser.add_argument("--markdown", default=None, help="with --all: write the table of verdicts to this file")


def run_from_args(args: argparse.Namespace) -> int:
    if args.all == (args.model is not None):
        args.fail("give one MODEL or --all")
    if args.all:
        return _run_all(args)
    from longstraw.models import verify
    from longstraw.planner.spec import load_config

    try:
        config = load_config(args.model)
    except ValueError as err:
        args.fail(str(err))
    verdict = with_planner(verify.verify(config), config)
    print(verdict.summary())
    if args.out:
        Path(args.out).write_text(json.dumps(dataclasses.asdict(verdict), indent=1) + "\n")
    return 0 if verdict.admitted else 1


def _run_all(args: argparse.Namespace) -> int:
    import transformers

    types = causal_lm_types()
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - set(types)
        if unknown:
            args.fail(f"not causal-LM types of transformers {transformers.__version__}: {', '.join(sorted(unknown))}")
        types = [t for t in types if t in wanted]
    rows = []
    for i, model_type in enumerate(types):
        row = _row(model_type)
        rows.append(row)
        print(f"[{i + 1}/{len(types)}] {model_type:<28} {row['kind']:<30} {_short(row)[:90]}", flush=True)
    decoders = [r for r in rows if r["decoder_only_text"]]
    print(f"{sum(r['kind'] != 'refused' for r in decoders)} of {len(decoders)} decoder-only text types admitted",
          file=sys.stderr)
    if args.out:
        meta = {"transformers": transformers.__version__, "python": platform.python_version(),
                "machine": platform.machine(), "time": time.strftime("%Y-%m-%d %H:%M:%S")}
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, args.out or "no results file"))
    return 0
