"""Admission by verification (`admission/verify.py`, `longstraw check`): the tiny copy keeps what shapes the
computation, a correct engine is admitted, a wrong one is refused with the measured difference and where it starts,
and the verdict is cached per config and version."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import transformers
from helpers import random_group

from longstraw import backward_group
from longstraw.admission import check, released, verify
from longstraw.admission.tiny import build_tiny_model, tiny_config
from longstraw.models import architecture


def _config(model_type: str, **values):
    return transformers.AutoConfig.for_model(model_type, **values)


def test_the_tiny_copy_keeps_multipliers_flags_and_the_layer_pattern():
    """Only sizes shrink: granite's multipliers, the router's settings and gpt-oss's alternating layers stay; windows
    go below the 37-token test prompt; depth is the shortest prefix holding every layer kind."""
    granite = _config("granite", logits_scaling=16.0, embedding_multiplier=12.0, residual_multiplier=0.22,
                      attention_multiplier=0.0078125, hidden_act="silu")
    tiny, note = tiny_config(granite)
    assert (tiny.logits_scaling, tiny.embedding_multiplier, tiny.residual_multiplier, tiny.attention_multiplier) == (
        16.0, 12.0, 0.22, 0.0078125)
    assert tiny.hidden_act == "silu" and tiny.hidden_size == 64 and tiny.num_hidden_layers == 2
    assert "2 of 40 layers" in note or tiny.num_hidden_layers < granite.num_hidden_layers

    oss = _config("gpt_oss")
    tiny, _ = tiny_config(oss)
    assert tiny.layer_types == oss.layer_types[: tiny.num_hidden_layers]
    assert set(tiny.layer_types) == set(oss.layer_types) and tiny.sliding_window <= 16
    assert tiny.num_local_experts == 4 and tiny.num_experts_per_tok == 2
    assert tiny.rope_parameters == oss.rope_parameters

    gemma = _config("gemma3_text")  # 5 sliding layers, then a global one: six layers keep the pattern
    tiny, _ = tiny_config(gemma)
    assert tiny.layer_types == gemma.layer_types[:6] and tiny.layer_types[-1] == "full_attention"
    assert tiny.query_pre_attn_scalar == gemma.query_pre_attn_scalar

    qwen = _config("qwen3_moe", num_key_value_heads=4, num_attention_heads=32)  # grouped heads stay grouped
    tiny, _ = tiny_config(qwen)
    assert (tiny.num_attention_heads, tiny.num_key_value_heads) == (4, 2) and tiny.norm_topk_prob == qwen.norm_topk_prob


def test_a_correct_family_is_admitted_with_its_numbers():
    config = _config("llama", rope_theta=500000.0)
    verdict = verify.verify(config)
    assert verdict.admitted and verdict.kind == "exact within float32 kernels"  # RMSNorm computes in float32
    assert verdict.logprob_error <= 1e-12 and verdict.sampled_error <= 1e-12 and verdict.gradient_error <= 1e-6
    assert verdict.planner_bytes is None and check.with_planner(verdict, config).planner_bytes == verdict.state_bytes


def test_a_model_computed_all_in_float64_is_exact():
    """GPT-2's layers have no float32 op inside (LayerNorm and GELU in the input dtype): the 1e-9 class."""
    verdict = verify.verify(_config("gpt2"))
    assert verdict.kind == "exact" and not verdict.float32_ops and verdict.tolerance == 1e-9
    assert verdict.gradient_error <= 1e-9


def test_a_wrong_logit_factor_is_refused_after_the_decoder(monkeypatch):
    """An engine that scaled the logits wrongly: refused with the measured log-prob difference, and no decoder layer
    differs (the difference comes after the decoder)."""
    from longstraw.engine.tree import plans as replay

    monkeypatch.setattr(replay, "logit_scale", lambda model: 2.0)
    verdict = verify.verify(_config("llama"))
    assert not verdict.admitted and verdict.logprob_error > 1e-3
    assert "no decoder layer" in verdict.first_difference
    message = verdict.refusal()
    assert "'llama' is refused" in message and "replayed log-probs off by" in message


def test_a_wrong_attention_is_refused_naming_the_first_layer(monkeypatch):
    """An attention kernel that dropped the prompt's K/V: refused, and the first layer that differs is layer 0."""
    from longstraw.engine.hf import segment

    real = segment.prefix_attention

    def forgetful(query, key, value, prefix_keys, prefix_values, scale, **kw):
        return real(query, key, value, [], [], scale, **kw)

    monkeypatch.setattr(segment, "prefix_attention", forgetful)
    verdict = verify.verify(_config("llama"))
    assert not verdict.admitted
    assert verdict.first_difference.startswith("layer 0 (")


@pytest.mark.parametrize("model_type, values", [
    ("phimoe", released.RELEASED["phimoe"]),  # Phi-3.5-MoE: a window on every layer, through the mask only
    ("qwen2_moe", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28}),  # sliding layers
])
def test_windows_applied_through_the_mask_only_are_read(model_type, values, monkeypatch):
    """PhiMoE and Qwen2-MoE pass no sliding_window to their attention call (their mask holds it): LongStraw reads the
    window itself and is exact; an engine that ignored it would be refused at layer 0."""
    config = _config(model_type, **values)
    assert verify.verify(config).admitted
    from longstraw.engine.hf import segment

    monkeypatch.setattr(segment, "_mask_window", lambda module, window: window)
    verdict = verify.verify(_config(model_type, **values))
    assert not verdict.admitted and verdict.logprob_error > 1e-3
    assert verdict.first_difference.startswith("layer 0 (")


def test_verdicts_are_cached_on_disk_per_config_and_version(monkeypatch, tmp_path):
    monkeypatch.setenv("LONGSTRAW_CACHE", str(tmp_path))
    monkeypatch.setattr(verify, "_VERDICTS", {})
    config = _config("gpt2")
    first = verify.verdict_for(config)
    files = list((tmp_path / "verdicts").glob("*.json"))
    assert len(files) == 1 and files[0].name.startswith(f"gpt2-{verify.config_hash(config)}-tf")
    assert json.loads(files[0].read_text())["kind"] == first.kind
    monkeypatch.setattr(verify, "_VERDICTS", {})
    monkeypatch.setattr(verify, "verify", lambda config: pytest.fail("measured again"))
    assert verify.verdict_for(config) == dataclasses.replace(first, from_cache=True)  # from the disk
    other = _config("gpt2", n_layer=3)
    assert verify.verdict_key(other) != verify.verdict_key(config)


def test_backward_group_admits_a_verified_type_and_refuses_a_wrong_one(monkeypatch, tmp_path):
    """A type off the CI list goes through the check once; a refused one fails before any parameter is touched."""
    monkeypatch.setenv("LONGSTRAW_CACHE", str(tmp_path))
    monkeypatch.setattr(verify, "_VERDICTS", {})
    model = build_tiny_model(tiny_config(_config("opt"))[0])
    assert model.config.model_type not in architecture.SUPPORTED_MODEL_TYPES
    backward_group(model, random_group(20, [3, 2]), plan="exact", chunk_size=8)
    assert list((tmp_path / "verdicts").glob("opt-*.json"))

    from longstraw.engine.tree import plans as replay

    monkeypatch.setattr(replay, "logit_scale", lambda model: 2.0)
    monkeypatch.setattr(verify, "_VERDICTS", {})
    monkeypatch.setenv("LONGSTRAW_CACHE", str(tmp_path / "other"))
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=r"'opt' is refused: a tiny float64 copy .*replayed log-probs off by"):
        backward_group(model, random_group(20, [3, 2]), plan="exact", chunk_size=8)
    assert all(p.grad is None for p in model.parameters())


def test_check_command_prints_the_verdict(tmp_path):
    config = _config("qwen3", num_hidden_layers=3, hidden_size=128, intermediate_size=256, num_attention_heads=8,
                     num_key_value_heads=2, head_dim=16, vocab_size=1000)
    config.save_pretrained(tmp_path)
    out = subprocess.run([sys.executable, "-m", "longstraw.cli", "check", str(tmp_path)], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "qwen3 (config " in out.stdout and "exact within float32 kernels" in out.stdout
    assert "exact vs standard gradient" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "longstraw.cli", "check"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "give one MODEL or --all" in bad.stderr
