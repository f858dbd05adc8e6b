"""`LongStrawGRPOTrainer`'s prefix tree over a micro-batch (its only path) against `trl.GRPOTrainer`, with
test_trl.py's setup (trl_setup.py: fixed completions, the float64 log-prob kernel): rows of different prompts after one
shared system prompt, and rows that are successive turns of one conversation (row k = row k−1 + more), each equal to
TRL's own update, sequence-level losses and kept prompt graphs included; the tree's statistics in TRL's logged metrics.

Successive turns have prompts of different lengths, which TRL left-pads: its forward then puts a padded prompt at
shifted positions, exact for RoPE in real numbers but not in transformers' float32 rotary angles (test_trl.py's
module docstring), so those cases agree with TRL to 1e-8 and with the drop-in's standard plan (every row a full
unpadded sequence through the model, no state), to 1e-12.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl", reason="TRL is an optional extra: pip install 'longstraw[trl]'")

import trl.trainer.utils  # noqa: E402
from helpers import assert_close, tiny_model  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl_setup import PROMPTS, Float64LogProbs, G, completions, train  # noqa: E402

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
    stats = _tree_stats(info)
    s = len(_ids(SYSTEM))
    print(f"gradient {err:.2g}; {stats}")
    assert stats["tokens_flattened"] - stats["tokens_encoded"] >= (2 * G - 1) * s


TURN_SETTINGS = dict(prompts=TURNS, rollout_func=successive_turns, per_device_train_batch_size=3 * G)


@pytest.mark.parametrize("config", [dict(loss_type="grpo", beta=0.04), dict(loss_type="dapo", num_iterations=2,
                                                                           max_steps=2, epsilon=0.05,
                                                                           learning_rate=5.0)],
                         ids=["grpo-kl", "dapo-off-policy"])
def test_successive_turns_equal_trl(tmp_path, model_dir, config):
    """Three turns of one conversation, G = 4 completions each, in one micro-batch: turn k's rows continue turn
    k−1's first row, so that row's tokens (and the shared question) are encoded once. Equal to TRL (1e-8: its
    padding, module docstring) and to the standard plan (1e-12); the off-policy case's second step reuses the
    completions with old log-probs (clipping active)."""
    info: dict = {}
    settings = {**TURN_SETTINGS, **config}
    g_trl, p_trl = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", **settings)
    g_ls, p_ls = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "ls", info=info, **settings)
    g_group, _ = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "standard",
                       longstraw_plan="standard", **settings)
    assert len(g_ls) == len(g_trl) == settings.get("max_steps", 1)
    for step, (ours, theirs, group) in enumerate(zip(g_ls, g_trl, g_group)):
        assert theirs.norm() > 0
        err = assert_close(f"step {step + 1} gradient against TRL", theirs, ours, 1e-8)
        err_group = assert_close(f"step {step + 1} gradient against the standard plan", group, ours, 1e-12)
        print(f"step {step + 1}: against TRL {err:.2g}, against the standard plan {err_group:.2g}")
    assert_close("parameters", p_trl, p_ls, 1e-8)
    stats = [{k.removeprefix("longstraw/"): v for k, v in entry.items() if k.startswith("longstraw/")}
             for entry in info["log_history"] if "longstraw/tokens_encoded" in entry]
    first_row = len(turn_prompt(1)) - len(_ids(FOLLOW_UP))  # turn 0's first row: prompt + completion
    print(stats)
    # that row is a prefix of itself and of the 2·G rows of turns 1 and 2: encoded once instead of 2·G + 1 times
    assert stats and all(s["tokens_flattened"] - s["tokens_encoded"] >= 2 * G * (first_row - 1) for s in stats)
    assert all(s["tree_depth"] >= 3 for s in stats)


def test_sequence_level_loss_on_shared_completions_runs_one_tree(tmp_path, model_dir):
    """GSPO's sequence ratio reads a row's whole completion, which here lies in a node other rows continue (turn 0's
    first row): the tree scores the batch first, then backpropagates each row's exact per-token share (docs/trees.md).
    One tree per micro-batch (its statistics logged), TRL's update (1e-8, its padding) and the standard plan's
    (1e-12)."""
    info: dict = {}
    settings = {**TURN_SETTINGS, "loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4,
                "epsilon_high": 4e-4}
    g_ls, _ = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "ls", info=info, **settings)
    g_trl, _ = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", **settings)
    g_std, _ = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "standard",
                     longstraw_plan="standard", **settings)
    assert g_trl[0].norm() > 0
    err = assert_close("gradient", g_trl[0], g_ls[0], 1e-8)
    print(f"gradient {err:.2g}, against the standard plan "
          f"{assert_close('gradient against the standard plan', g_std[0], g_ls[0], 1e-12):.2g}")
    assert _tree_stats(info)["tree_depth"] >= 3


def test_kept_prompt_graphs_run_in_the_tree(tmp_path, model_dir):
    """longstraw_keep_prompt_graph: the tree keeps its nodes' last chunks' capture graphs; TRL's update to 1e-12, one
    tree per micro-batch."""
    info: dict = {}
    g_trl, _ = train(GRPOTrainer, GRPOConfig, model_dir, tmp_path / "trl", prompts=SHARED, loss_type="grpo")
    g_ls, _ = train(LongStrawGRPOTrainer, LongStrawGRPOConfig, model_dir, tmp_path / "ls", prompts=SHARED,
                    info=info, loss_type="grpo", longstraw_keep_prompt_graph=1, longstraw_chunk_size=16)
    print(f"gradient {assert_close('gradient', g_trl[0], g_ls[0], 1e-12):.2g}")
    assert _tree_stats(info)["tree_nodes"] >= 3


def test_no_per_group_path_remains():
    """The integrations run one tree per batch and nothing else: no module of them calls backward_group."""
    from pathlib import Path

    import longstraw.integrations

    folder = Path(longstraw.integrations.__file__).parent
    calls = [p.name for p in folder.glob("*.py") if "backward_group" in p.read_text()]
    assert calls == []


@pytest.mark.parametrize("overrides,reason", [
    (dict(longstraw_tree_min_shared=0), "longstraw_tree_min_shared must be an integer >= 1, got 0"),
])
def test_tree_options_are_checked_when_the_config_is_built(tmp_path, overrides, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        LongStrawGRPOConfig(output_dir=str(tmp_path), num_generations=G, per_device_train_batch_size=2 * G,
                            bf16=False, report_to="none", **overrides)
