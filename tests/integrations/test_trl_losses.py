"""The TRL loss options beyond grpo/dr_grpo/dapo/gspo (loss types bnpo, cispo, sapo, luspo, vespo, the
sequence-level ratio with other losses, two-sided clipping `delta`): `LongStrawGRPOTrainer` against
`trl.GRPOTrainer` in float64, with test_trl.py's setup (trl_setup.py: fixed completions, float64 log-prob kernel).

Every case runs 2 optimizer steps with num_iterations = 2, β = 0.04 and TRL's reference model, and a large learning
rate: the second step reuses the completions with TRL's old log-probs, so the ratios are off 1 and every ratio-
dependent part of a loss (clip, delta, cispo's cap, sapo's gate, vespo's weight) is exercised; the optimizer
steps' gradients and the parameters after must agree to 1e-12 relative. Then what stays refused.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'longstraw[trl]'")

import trl.trainer.grpo_trainer  # noqa: E402
import trl.trainer.utils  # noqa: E402
from datasets import Dataset  # noqa: E402
from helpers import assert_close, rel_err, tiny_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_setup import MAX_COMPLETION, PROMPTS, Float64LogProbs, G, reward, train  # noqa: E402

from longstraw.integrations.trl import LongStrawGRPOConfig, LongStrawGRPOTrainer  # noqa: E402
from longstraw.models.tokenizer import byte_tokenizer_hf  # noqa: E402

OFF_POLICY = dict(num_iterations=2, max_steps=2, beta=0.04, learning_rate=5.0, mask_truncated_completions=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl-losses-llama")
    tiny_model("llama", dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def float64_trl_kernel(monkeypatch):
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", Float64LogProbs)


def _compare(tmp_path, model_dir, **config):
    """Both trainers on the same run; returns the drop-in's gradients."""
    settings = {**OFF_POLICY, **config}
    g_trl, p_trl = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", **settings)
    g_ls, p_ls = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "ls", **settings)
    assert len(g_ls) == len(g_trl) == settings["max_steps"]
    for step, (a, b) in enumerate(zip(g_ls, g_trl)):
        assert b.norm() > 0
        assert_close(f"step {step + 1} gradient", b, a, 1e-12)
    assert_close("parameters", p_trl, p_ls, 1e-12)
    print(f"gradient {max(rel_err(a, b) for a, b in zip(g_ls, g_trl)):.2g}, parameters {rel_err(p_ls, p_trl):.2g}")
    return g_ls


# TRL's SAPO temperatures and VESPO shape go through torch.where of two Python floats, which rounds them to float32
# (TRL's default sapo_temperature_neg 1.05 becomes 1.0499999523); LongStraw keeps the loss's dtype. The cases use
# values float32 represents exactly, so float64 equality is not blurred by that rounding.
CASES = {
    "bnpo": dict(loss_type="bnpo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.02),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=1.5, sapo_temperature_neg=1.25),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence", epsilon=0.01),
    "luspo-token": dict(loss_type="luspo", epsilon=0.05),
    # vespo's weight vanishes for sequence log-ratios of a few units: a smaller step keeps them within ±2
    "vespo": dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5, learning_rate=0.02),
    "dapo-sequence": dict(loss_type="dapo", importance_sampling_level="sequence", epsilon=0.01),
    "dr_grpo-sequence": dict(loss_type="dr_grpo", importance_sampling_level="sequence", epsilon=0.01),
    "cispo-sequence": dict(loss_type="cispo", importance_sampling_level="sequence", epsilon_high=1.01),
    "sapo-sequence": dict(loss_type="sapo", importance_sampling_level="sequence", sapo_temperature_neg=1.125),
    "grpo-delta": dict(loss_type="grpo", epsilon=0.05, delta=1.06),
    "bnpo-delta": dict(loss_type="bnpo", epsilon=0.05, delta=1.06),
}
# The cases whose option only acts on some ratios: the same run without it must give another second-step gradient,
# so that the equality checks the option's effect on this data.
WITHOUT = {"cispo": dict(epsilon_high=5.0), "vespo": dict(vespo_k_pos=2.0, vespo_lambda_neg=2.0),
           "grpo-delta": dict(delta=None), "bnpo-delta": dict(delta=None)}


@pytest.mark.parametrize("case", list(CASES))
def test_loss_option_equals_trl(tmp_path, model_dir, case):
    g_ls = _compare(tmp_path, model_dir, **CASES[case])
    if case in WITHOUT:
        (_, plain), _ = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "without",
                              **{**OFF_POLICY, **CASES[case], **WITHOUT[case]})
        assert rel_err(g_ls[1], plain) > 1e-6


def test_bnpo_over_accumulated_micro_batches_is_trl_with_groups_kept_together(tmp_path, model_dir, monkeypatch):
    """bnpo with per_device_train_batch_size = G and 2 micro-batches per generation batch: TRL shuffles the rows
    before cutting micro-batches, the drop-in deals whole groups, so bnpo's normaliser (the micro-batch's tokens)
    is TRL's for the one shuffle that keeps groups together. With TRL's shuffle made the identity the two agree;
    with TRL's own shuffle they do not (the micro-batches hold other rows). The two prompts' groups differ in tokens
    (22 and 28: trl_setup's 4th completion is cut at max_completion_length for an even byte sum only), so bnpo's
    normaliser is not dapo's here."""
    prompts = [PROMPTS[0], PROMPTS[0].replace("item 00", "item 01")]
    config = dict(loss_type="bnpo", per_device_train_batch_size=G, gradient_accumulation_steps=2, max_steps=1,
                  prompts=prompts)
    g_ls, p_ls = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "ls", **config)
    g_shuffled, _ = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl-shuffled", **config)
    monkeypatch.setattr(trl.trainer.grpo_trainer, "shuffle_sequence_dict", lambda batch: batch)
    g_trl, p_trl = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", **config)
    err = assert_close("gradient", g_trl[0], g_ls[0], 1e-12)
    assert_close("parameters", p_trl, p_ls, 1e-12)
    print(f"gradient {err:.2g}; against TRL's own shuffle {rel_err(g_ls[0], g_shuffled[0]):.2g}")
    assert rel_err(g_ls[0], g_shuffled[0]) > 1e-4


def _build(tmp_path, model_dir, **overrides):
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2 * G, num_generations=G,
                    bf16=False, report_to="none", max_completion_length=MAX_COMPLETION)
    settings.update(overrides)
    return LongStrawGRPOTrainer(AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward,
                                args=LongStrawGRPOConfig(**settings),
                                train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                processing_class=byte_tokenizer_hf())


@pytest.mark.parametrize("overrides,reason", [
    (dict(loss_type="bnpo", per_device_train_batch_size=2, gradient_accumulation_steps=2),
     "loss_type='bnpo' with per_device_train_batch_size (2) not a multiple of num_generations (4)"),
    (dict(importance_sampling_level="segment"), "importance_sampling_level='segment': only 'token' and 'sequence'"),
    (dict(loss_type="sapo", sapo_temperature_neg=0.0), "sapo_temperature_neg must be a finite number > 0"),
    (dict(loss_type="cispo", epsilon_high=0.0), "cispo's epsilon_high (the weight cap) must be a finite number > 0"),
    (dict(loss_type="grpo", delta=-1.0), "delta must be a finite number > 0"),
    (dict(loss_type="grpo", epsilon=1.5), "epsilon_low must be < 1"),
    (dict(cast_lm_head_to_fp32=True), "cast_lm_head_to_fp32=True: over bfloat16/float16 parameters"),
])
def test_what_stays_refused(tmp_path, model_dir, overrides, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        _build(tmp_path, model_dir, **overrides)


def test_delta_with_an_unclipped_loss_is_ignored_as_trl_does(tmp_path, model_dir):
    """TRL applies delta to its clipped losses only; with sapo it is accepted and has no effect, in both."""
    trainer = _build(tmp_path, model_dir, loss_type="sapo", delta=1.5)
    assert trainer.args.delta == 1.5
