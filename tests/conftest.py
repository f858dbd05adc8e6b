"""Shared fixtures: tiny random models of every supported family, float64-faithful, and random groups."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from longstraw import Group, load_model

VOCAB = 512


def _rms_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


def faithful_float64(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' RMSNorm computes in float32 and casts back, which in a float64 model *rounds to
    float32*: two mathematically equal paths then differ by ~1e-8 of float32 rounding noise, and float64
    parity at 1e-10 would be meaningless. Tests patch every RMSNorm instance (both sides of every comparison
    use the same model object) to compute in the input dtype. Library code is untouched."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_in_input_dtype, module)
    return model


def _configs() -> dict[str, object]:
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=VOCAB, max_position_embeddings=1024)
    return {
        "llama": LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **common),
        "qwen3": Qwen3Config(num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, **common),
        "qwen2": Qwen2Config(num_key_value_heads=2, tie_word_embeddings=False, **common),
        "mistral": MistralConfig(num_key_value_heads=4, sliding_window=None, tie_word_embeddings=False, **common),
    }


def tiny_model(family: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    """A random-init model of `family` (llama, qwen3, qwen2, mistral), eval mode, params requiring grad."""
    config = _configs()[family]
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    for p in model.parameters():
        p.requires_grad_(True)
    if dtype == torch.float64:
        faithful_float64(model)
    return model


def random_group(prompt_len: int, lengths: list[int], seed: int = 0, dtype=torch.float64, vocab: int = VOCAB,
                 **extra) -> Group:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
    responses = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    advantages = torch.randn(len(lengths), generator=gen, dtype=dtype)
    return Group(prompt=prompt, responses=responses, advantages=advantages, **extra)


def grads(model: torch.nn.Module) -> torch.Tensor:
    """All parameter gradients flattened into one vector (zeros where a parameter got none)."""
    return torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()
    ])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="session")
def tiny_llama64():
    return faithful_float64(load_model("tiny-llama", dtype="float64"))
