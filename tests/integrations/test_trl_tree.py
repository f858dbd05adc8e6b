"""`LongStrawGRPOTrainer`'s prefix tree over a micro-batch (`longstraw_tree`, on by default) against
`trl.GRPOTrainer`, with test_trl.py's setup (trl_setup.py: fixed completions, the float64 log-prob kernel): rows of
different prompts after one shared system prompt, and rows that are successive turns of one conversation (row k =
row k−1 + more), each equal to TRL's own update; the tree's statistics in TRL's logged metrics; the per-group path
(`longstraw_tree=False`, and where a tree cannot run, with the reason logged).

Successive turns have prompts of different lengths, which TRL left-pads: its forward then puts a padded prompt at
shifted positions, exact for RoPE in real numbers but not in transformers' float32 rotary angles (test_trl.py's
module docstring), so those cases agree with TRL to 1e-8 and with LongStraw's per-group path, which runs every row
unpadded as the tree does, to 1e-12.
"""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'longstraw[trl]'")

import trl.trainer.utils  # noqa: E402
from datasets import Dataset  # noqa: E402
from helpers import assert_close, tiny_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_setup import MAX_COMPLETION, PROMPTS, Float64LogProbs, G, completions, reward, train  # noqa: E402

from longstraw.integrations.trl import LongStrawGRPOConfig, LongStrawGRPOTrainer  # noqa: E402
from longstraw.models.tokenizer import byte_tokenizer_hf  # noqa: E402

SYSTEM = ("System: you are a careful assistant in a shop. Tools: lookup(item) -> record, colour(item) -> name. "
          "Answer in one word.\n")
SHARED = [SYSTEM + p for p in PROMPTS]  # equal lengths: no padding in TRL's batch
TURNS = ["turn 0", "turn 1", "turn 2"]  # the dataset's markers; `successive_turns` makes their prompts
QUESTION = "User: what is the colour of item 07?"
FOLLOW_UP = " User: and then?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("trl-tree-llama")
    tiny_model("llama", dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def float64_trl_kernel(monkeypatch):
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", Float64LogProbs)


def _ids(text: str) -> list[int]:
    return byte_tokenizer_hf()(text, add_special_tokens=False)["input_ids"]


def turn_prompt(k: int) -> list[int]:
    """Turn k's prompt: the question, then for k > 0 turn k−1's prompt + its first completion + a follow-up."""
    if k == 0:
        return _ids(QUESTION)
    previous = turn_prompt(k - 1)
    (first, *_), _ = completions(SimpleNamespace(processing_class=byte_tokenizer_hf()), [previous] * G, None, None, G)
    return previous + first + _ids(FOLLOW_UP)


def successive_turns(prompts, trainer):
    """A rollout_func: each entry of `prompts` (a TURNS marker, G times) becomes its turn's prompt, with
    trl_setup's fixed completions, so the first row of turn k−1 (its prompt and completion) is a prefix of every row
    of turn k."""
    prompt_ids = [turn_prompt(TURNS.index(p)) for p in prompts]
    completion_ids, _ = completions(trainer, prompt_ids, None, None, trainer.num_generations)
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def _tree_stats(info: dict) -> dict[str, float]:
    logged = [entry for entry in info["log_history"] if "longstraw/tokens_encoded" in entry]
    assert len(logged) == 1, info["log_history"]
    return {key.removeprefix("longstraw/"): value for key, value in logged[0].items() if key.startswith("longstraw/")}


@pytest.mark.parametrize("config", [dict(loss_type="grpo", beta=0.04), dict(loss_type="dapo"),
                                    dict(loss_type="dr_grpo", beta=0.04, mask_truncated_completions=True)],
                         ids=["grpo-kl", "dapo", "dr_grpo-masked"])
def test_shared_system_prompt_across_groups_equals_trl(tmp_path, model_dir, config):
    """Two prompts (different questions after one system prompt of S tokens), G = 4 each, one micro-batch: the
    tree encodes the system prompt once instead of 8 times, and the update is TRL's to 1e-12. dr_grpo with
    mask_truncated_completions leaves rows out of one group only: per-row weights that no per-prompt-group scale
    could give (the tree's groups are its rows)."""
    info: dict = {}
    g_trl, p_trl = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", prompts=SHARED, **config)
    g_ls, p_ls = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "ls", prompts=SHARED,
                       info=info, **config)
    assert g_trl[0].norm() > 0
    err = assert_close("gradient", g_trl[0], g_ls[0], 1e-12)
    assert_close("parameters", p_trl, p_ls, 1e-12)
    assert info["tree_fallbacks"] == []
    stats = _tree_stats(info)
    s = len(_ids(SYSTEM))
    print(f"gradient {err:.2g}; {stats}")
    assert stats["tokens_flattened"] - stats["tokens_encoded"] >= (2 * G - 1) * s


def test_shared_system_prompt_per_group_switch(tmp_path, model_dir):
    """longstraw_tree=False: backward_group per prompt's group, TRL's update too, and no tree in the metrics."""
    info: dict = {}
    g_trl, _ = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", prompts=SHARED, loss_type="grpo")
    g_ls, _ = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "ls", prompts=SHARED,
                    info=info, loss_type="grpo", longstraw_tree=False)
    print(f"gradient {assert_close('gradient', g_trl[0], g_ls[0], 1e-12):.2g}")
    assert not any("longstraw/tokens_encoded" in entry for entry in info["log_history"])


TURN_SETTINGS = dict(prompts=TURNS, rollout_func=successive_turns, per_device_train_batch_size=3 * G)


@pytest.mark.parametrize("config", [dict(loss_type="grpo", beta=0.04), dict(loss_type="dapo", num_iterations=2,
                                                                           max_steps=2, epsilon=0.05,
                                                                           learning_rate=5.0)],
                         ids=["grpo-kl", "dapo-off-policy"])
def test_successive_turns_equal_trl(tmp_path, model_dir, config):
    """Three turns of one conversation, G = 4 completions each, in one micro-batch: turn k's rows continue turn
    k−1's first row, so that row's tokens (and the shared question) are encoded once. Equal to TRL (1e-8: its
    padding, module docstring) and to the per-group path (1e-12); the off-policy case's second step reuses the
    completions with old log-probs (clipping active)."""
    info: dict = {}
    settings = {**TURN_SETTINGS, **config}
    g_trl, p_trl = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", **settings)
    g_ls, p_ls = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "ls", info=info, **settings)
    g_group, p_group = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "group",
                             longstraw_tree=False, **settings)
    assert len(g_ls) == len(g_trl) == settings.get("max_steps", 1)
    for step, (ours, theirs, group) in enumerate(zip(g_ls, g_trl, g_group)):
        assert theirs.norm() > 0
        err = assert_close(f"step {step + 1} gradient against TRL", theirs, ours, 1e-8)
        err_group = assert_close(f"step {step + 1} gradient against the per-group path", group, ours, 1e-12)
        print(f"step {step + 1}: against TRL {err:.2g}, against the per-group path {err_group:.2g}")
    assert_close("parameters", p_trl, p_ls, 1e-8)
    assert info["tree_fallbacks"] == []
    stats = [{k.removeprefix("longstraw/"): v for k, v in entry.items() if k.startswith("longstraw/")}
             for entry in info["log_history"] if "longstraw/tokens_encoded" in entry]
    first_row = len(turn_prompt(1)) - len(_ids(FOLLOW_UP))  # turn 0's first row: prompt + completion
    print(stats)
    # that row is a prefix of itself and of the 2·G rows of turns 1 and 2: encoded once instead of 2·G + 1 times
    assert stats and all(s["tokens_flattened"] - s["tokens_encoded"] >= 2 * G * (first_row - 1) for s in stats)
    assert all(s["tree_depth"] >= 3 for s in stats)


def test_sequence_level_loss_on_shared_completions_falls_back_per_group(tmp_path, model_dir, caplog):
    """GSPO's sequence ratio reads a row's whole completion at once, which a tree cannot when the completion lies in
    a node other rows continue (turn 0's first row here): that batch runs backward_group per prompt's group, with the
    reason logged once; still TRL's update."""
    info: dict = {}
    settings = {**TURN_SETTINGS, "loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4,
                "epsilon_high": 4e-4}
    with caplog.at_level(logging.WARNING, logger="longstraw.integrations.tree_batch"):
        g_ls, _ = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "ls", info=info, **settings)
    g_trl, _ = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", **settings)
    print(f"gradient {assert_close('gradient', g_trl[0], g_ls[0], 1e-8):.2g}")
    (reason,) = info["tree_fallbacks"]
    assert "the sequence ratio" in reason and "shared node" in reason
    (record,) = [r for r in caplog.records if r.name == "longstraw.integrations.tree_batch"]  # logged once
    assert "each prompt's group runs backward_group" in record.getMessage() and reason in record.getMessage()
    assert not any("longstraw/tokens_encoded" in entry for entry in info["log_history"])


def _build(tmp_path, model_dir, **overrides):
    settings = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2 * G, num_generations=G,
                    bf16=False, report_to="none", max_completion_length=MAX_COMPLETION)
    return LongStrawGRPOTrainer(AutoModelForCausalLM.from_pretrained(model_dir), reward_funcs=reward,
                                args=LongStrawGRPOConfig(**settings | overrides),
                                train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                processing_class=byte_tokenizer_hf())


def test_options_a_tree_cannot_run_fall_back_when_the_trainer_is_built(tmp_path, model_dir, caplog):
    """keep_prompt_graph: the reason is logged when the trainer is built, and every batch takes the per-group path;
    with the tree switched off nothing is logged."""
    with caplog.at_level(logging.WARNING, logger="longstraw.integrations.tree_batch"):
        trainer = _build(tmp_path, model_dir, longstraw_keep_prompt_graph=1)
        (reason,) = trainer.tree_fallbacks.reasons
        assert "keep_prompt_graph" in reason and reason in caplog.text
        caplog.clear()
        off = _build(tmp_path, model_dir, longstraw_keep_prompt_graph=1, longstraw_tree=False)
        assert off.tree_fallbacks.reasons == []
        assert not [r for r in caplog.records if r.name == "longstraw.integrations.tree_batch"]


@pytest.mark.parametrize("overrides,reason", [
    (dict(longstraw_tree="yes"), "longstraw_tree must be True or False, got 'yes'"),
    (dict(longstraw_tree_min_shared=0), "longstraw_tree_min_shared must be an integer >= 1, got 0"),
])
def test_tree_options_are_checked_when_the_config_is_built(tmp_path, overrides, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        LongStrawGRPOConfig(output_dir=str(tmp_path), num_generations=G, per_device_train_batch_size=2 * G,
                            bf16=False, report_to="none", **overrides)
