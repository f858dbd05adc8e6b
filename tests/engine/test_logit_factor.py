"""The factor and soft-cap each causal LM applies between its decoder's final hidden states and its logits.

LongStraw's replay returns the decoder's hidden states (`run_segment`) and forms the logits itself (`logprobs.py`,
the sampler), so whatever the causal LM's forward does after the decoder must be read from the config:
`architecture.logit_scale` (one multiplicative factor) and `architecture.logit_softcap` (Gemma-2's final soft-cap).
For every family transformers 5.24 has with such a factor, a tiny float64 model's own logits must equal
cap(base_model(ids) @ W.T * logit_scale), with the released checkpoints' multipliers where one is known.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import VOCAB, faithful_float64

from longstraw.models.architecture import logit_scale, logit_softcap

_SIZES = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=1024, pad_token_id=None, bos_token_id=None, eos_token_id=None)
_GRANITE = dict(logits_scaling=16.0, embedding_multiplier=12.0, residual_multiplier=0.22,
                attention_multiplier=0.0078125)  # granite-3.x-8b
_GRANITE_H = dict(logits_scaling=3.0, embedding_multiplier=12.0, residual_multiplier=0.246,
                  attention_multiplier=0.015625)  # granite-4.0-h-350m

# model type -> (config class name, its fields beyond _SIZES, the factor logit_scale must return, the soft-cap)
CASES: dict[str, tuple[str, dict, float, float | None]] = {
    "llama": ("LlamaConfig", {}, 1.0, None),
    "cohere": ("CohereConfig", dict(logit_scale=0.0625, use_qk_norm=False), 0.0625, None),  # command-r v1
    "cohere2": ("Cohere2Config", dict(logit_scale=0.0625, sliding_window=16,  # Command R7B
                                      layer_types=["sliding_attention", "full_attention"]), 0.0625, None),
    "cohere2_moe": ("Cohere2MoeConfig", dict(logit_scale=0.0625), 0.0625, None),
    "granite": ("GraniteConfig", _GRANITE, 1 / 16, None),
    "granitemoe": ("GraniteMoeConfig", dict(_GRANITE, num_local_experts=4, num_experts_per_tok=2), 1 / 16, None),
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(_GRANITE, num_local_experts=4, num_experts_per_tok=2,
                                                         shared_intermediate_size=32), 1 / 16, None),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(_GRANITE_H, num_local_experts=4, num_experts_per_tok=2,
                                                         shared_intermediate_size=32, mamba_n_heads=8, mamba_d_state=16,
                                                         mamba_d_head=16, mamba_chunk_size=16,
                                                         layer_types=["mamba", "attention"]), 1 / 3, None),
    "granite_swa": ("GraniteSWAConfig", _GRANITE, 1 / 16, None),
    "granitemoe_swa": ("GraniteMoeSWAConfig", dict(_GRANITE, num_local_experts=4, num_experts_per_tok=2), 1 / 16,
                       None),
    "hyperclovax": ("HyperCLOVAXConfig", dict(logits_scaling=0.125), 0.125, None),
    # MiniCPM3's logits_scaling is hidden_size / dim_model_base (10 in MiniCPM3-4B; 4 at hidden 64)
    "minicpm3": ("MiniCPM3Config", dict(dim_model_base=16, num_key_value_heads=4), 1 / 4, None),
    "falcon_h1": ("FalconH1Config", dict(lm_head_multiplier=0.0390625, mamba_d_ssm=128, mamba_n_heads=8,
                                         mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16), 0.0390625, None),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=16,  # gemma-2-9b
                                    final_logit_softcapping=30.0, attn_logit_softcapping=50.0), 1.0, 30.0),
}


def _model(model_type: str) -> torch.nn.Module:
    name, fields, _, _ = CASES[model_type]
    cls = getattr(transformers, name, None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    config = cls(**{**_SIZES, **fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                          experts_implementation="eager")
    return faithful_float64(model.to(torch.float64).eval())


@pytest.mark.parametrize("model_type", list(CASES))
def test_logits_are_the_decoder_output_times_the_factor(model_type):
    model = _model(model_type)
    _, _, factor, cap = CASES[model_type]
    assert model.config.model_type == model_type
    assert logit_scale(model) == pytest.approx(factor, rel=1e-15) and logit_softcap(model) == cap
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        if cap is not None:  # logits up to 2 * cap, into tanh's curved part (a random tiny model's are far below)
            weight = model.get_output_embeddings().weight
            weight.mul_(2 * cap / model(input_ids=ids, use_cache=False).logits.abs().max())
        logits = model(input_ids=ids, use_cache=False).logits
        hidden = model.base_model(input_ids=ids, use_cache=False).last_hidden_state
        ours = hidden @ model.get_output_embeddings().weight.t() * logit_scale(model)
        if cap is not None:
            ours = cap * torch.tanh(ours / cap)
    err = float((ours - logits).abs().max() / logits.abs().max())
    assert err < 1e-12, err
    if factor != 1.0 or cap is not None:  # the factor or cap is not a no-op on this model
        plain = hidden @ model.get_output_embeddings().weight.t()
        assert float((plain - logits).abs().max() / logits.abs().max()) > 1e-2


def _capped_gemma2() -> torch.nn.Module:
    """The tiny gemma2 family model (gemma-2-9b's caps: attention 50, final 30) with its tied embedding scaled so that
    its logits reach the final cap's curved part: a random tiny model's logits (~0.2) are too small to show the cap."""
    from helpers import tiny_model

    model = tiny_model("gemma2")
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=False).logits.abs().max()
        model.get_output_embeddings().weight.mul_(60.0 / before)  # logits up to ~2 * cap
    return model


def test_gemma2_replay_and_sampling_apply_the_final_softcap(monkeypatch):
    """End to end: the exact plan's log-probs and gradient equal the standard plan's (transformers' own soft-capped
    logits), and the sampler's log-probs equal a full forward's, on a model whose logits reach the cap; without the
    cap both would be far off."""
    from helpers import FP32_KERNELS_F64, grads, random_group

    import longstraw.engine.sampling as sampling
    import longstraw.engine.tree.plans as replay
    from longstraw import backward_group

    model = _capped_gemma2()
    group = random_group(37, [5, 1, 9], seed=37)

    def run(plan):
        model.zero_grad()
        result = backward_group(model, group, plan=plan, chunk_size=13)
        return grads(model).clone(), torch.cat(result.logprobs)

    def sampled_error():
        prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(8))
        rollout = sampling.sample_group(model, prompt, 3, sampling.SamplingConfig(max_new_tokens=6), seed=1,
                                        chunk_size=16)
        err = 0.0
        for response, logp in zip(rollout.responses, rollout.logprobs):
            with torch.no_grad():
                logits = model(input_ids=torch.cat([prompt, response])[None], use_cache=False).logits[0]
            ref = torch.log_softmax(logits[39:-1], -1).gather(-1, response[:, None]).squeeze(-1)
            err = max(err, float((ref - logp).abs().max()))
        return err

    g_std, lp_std = run("standard")
    g_exact, lp_exact = run("exact")
    assert float((lp_std - lp_exact).abs().max()) <= FP32_KERNELS_F64
    assert float((g_exact - g_std).norm() / g_std.norm()) <= FP32_KERNELS_F64
    assert sampled_error() <= 10 * FP32_KERNELS_F64
    monkeypatch.setattr(replay, "logit_softcap", lambda model: None)  # the cap dropped: far off
    monkeypatch.setattr(sampling, "logit_softcap", lambda model: None)
    g_uncapped, lp_uncapped = run("exact")
    assert float((lp_std - lp_uncapped).abs().max()) > 1e-1
    assert float((g_uncapped - g_std).norm() / g_std.norm()) > 1e-2
    assert sampled_error() > 1e-1


def test_falcon_h1_replay_applies_its_lm_head_multiplier():
    """Falcon-H1's causal LM multiplies its logits by `lm_head_multiplier` (about 0.039 in the released checkpoints;
    the tiny test family keeps the class default 1.0): with the released value, the replayed log-probs equal the
    standard plan's (transformers' own logits), and the sampler's equal a full forward's."""
    from helpers import FP32_KERNELS_F64, random_group, tiny_config

    from longstraw import backward_group
    from longstraw.engine.sampling import SamplingConfig, sample_group

    config = tiny_config("falcon_h1")
    config.lm_head_multiplier = 0.0390625
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = faithful_float64(model.to(torch.float64).eval())
    assert logit_scale(model) == 0.0390625
    group = random_group(37, [5, 1, 9], seed=37)
    std = torch.cat(backward_group(model, group, plan="standard", chunk_size=13).logprobs)
    exact = torch.cat(backward_group(model, group, plan="exact", chunk_size=13).logprobs)
    assert float((std - exact).abs().max()) <= FP32_KERNELS_F64
    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(8))
    rollout = sample_group(model, prompt, 2, SamplingConfig(max_new_tokens=4), seed=1, chunk_size=16)
    for response, logp in zip(rollout.responses, rollout.logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, response])[None], use_cache=False).logits[0]
        ref = torch.log_softmax(logits[39:-1], -1).gather(-1, response[:, None]).squeeze(-1)
        assert float((ref - logp).abs().max()) <= 10 * FP32_KERNELS_F64
