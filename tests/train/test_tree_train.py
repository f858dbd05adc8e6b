"""`longstraw train --rollout tree`: each prompt's rollout is a tree (trunks that fork), trained with `backward_tree`
on the prefix tree of its leaves; the tree's shape and its encoded vs flattened tokens are in metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import longstraw
from longstraw import load_model
from longstraw.cli import main
from longstraw.distributed.runtime import Parallel
from longstraw.models.tokenizer import load_tokenizer
from longstraw.tasks.lookup import LookupTask
from longstraw.train.config import TrainConfig
from longstraw.train.data import TaskData
from longstraw.train.sampler import Sampler
from longstraw.train.trainer import Trainer

SRC = Path(longstraw.__file__).resolve().parents[1]
TREE_KEYS = {"tree_nodes", "tree_leaves", "tree_depth", "tree_tokens_encoded", "tree_tokens_flattened",
             "tree_encoded_fraction", "rollout_forks", "rollout_tokens_sampled", "rollout_tokens_flattened"}


def test_the_train_command_runs_a_tree_rollout_on_the_lookup_task(tmp_path):
    """The command line (in this process) on a tiny preset; random weights write no tool call, so the trees fork
    every 4 tokens here: two steps, the tree's statistics in every metrics row."""
    run = tmp_path / "run"
    code = main(["train", "--model", "tiny-llama", "--task", "lookup", "--prompt-tokens", "500", "--rollout", "tree",
                 "--tree-trigger", "tokens", "--tree-every", "4", "--tree-depth", "3", "--tree-leaves", "6",
                 "--max-new-tokens", "12", "--steps", "2", "--eval-prompts", "0", "--no-plot", "--run-dir", str(run)])
    assert code == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert TREE_KEYS <= set(r)
        assert 2 < r["tree_leaves"] <= 6 and r["rollout_forks"] >= 1
        assert r["tree_tokens_encoded"] < r["tree_tokens_flattened"]  # the prompt once, not once per leaf
        assert r["rollout_tokens_sampled"] < r["rollout_tokens_flattened"]  # the trunks' tokens once


def _agent_task(monkeypatch, cfg: TrainConfig) -> None:
    """A random-init model never writes "</lookup>": the call's closing token is the one it writes most often, the
    environment answers every call, and the reward is the response's length mod 3 (the plumbing, not learning)."""
    tokenizer = load_tokenizer(cfg.model.model)
    data = TaskData(cfg, tokenizer, max_positions=2048)
    group_options = {k: v for k, v in cfg.to_flat().items() if not k.startswith("tree_")}  # refused with groups
    plain = TrainConfig.from_flat({**group_options, "rollout": "group", "group_size": 4})
    model = load_model(cfg.model.model).eval()
    free = Sampler(plain, data, (), None, Parallel()).rollout(model, 0, 0, data.examples(0)[0])
    frequent = int(torch.cat(free.group.responses).bincount().argmax())
    monkeypatch.setattr(TaskData, "call_end", property(lambda self: (frequent,)))
    monkeypatch.setattr(LookupTask, "observe", lambda self, response, example: "<result>phone: 1234</result>")
    monkeypatch.setattr(LookupTask, "reward", lambda self, completion, example: float(len(completion) % 3))


@pytest.mark.parametrize("advantage", ["grpo", "siblings"])
def test_a_tree_step_forks_at_tool_calls_and_trains(monkeypatch, tmp_path, advantage):
    cfg = TrainConfig.from_flat(
        model="tiny-llama", task="lookup", prompt_tokens=500, max_new_tokens=40, top_k=4, max_turns=3, rollout="tree",
        tree_trunks=2, tree_depth=3, tree_leaves=6, tree_advantage=advantage, steps=1, eval_prompts=0, plot=False,
        lr=1e-3, run_dir=str(tmp_path / "run"))
    _agent_task(monkeypatch, cfg)
    Trainer(cfg).run()
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["rollout_forks"] >= 1 and row["tool_calls"] >= row["rollout_forks"]
    assert row["tree_leaves"] == 2 + row["rollout_forks"] and row["observation_tokens"] > 0
    assert row["grad_norm"] > 0 and row["loss"] != 0 and row["skipped_zero_advantage"] == 0


@pytest.mark.parametrize("options,match", [
    ({"rollout": "forest"}, "rollout 'forest' is unknown"),
    ({"rollout": "tree", "tree_branching": 1}, "tree_branching must be >= 2"),
    ({"rollout": "tree", "tree_trunks": 4, "tree_leaves": 3}, "raise --tree-leaves or lower --tree-trunks"),
    ({"rollout": "tree", "tree_trigger": "tokens"}, "set --tree-every N"),
    ({"rollout": "tree", "tree_every": 3}, "applies to --tree-trigger tokens"),
    ({"rollout": "tree", "task": "passkey"}, "task 'passkey' has none of"),
    ({"rollout": "tree", "plan": "standard_batched"}, "plans are exact, detach and standard"),
    ({"rollout": "tree", "tree_trigger": "tool_calls"}, "did you mean tool_call"),
    ({"rollout": "tree", "tree_advantage": "sibling"}, "did you mean siblings"),
])
def test_bad_tree_options_are_clear_errors(options, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flat(task=options.pop("task", "lookup"), **options)


def test_help_lists_the_rollout_values():
    out = subprocess.run([sys.executable, "-m", "longstraw.cli", "train", "--help"], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(SRC)), timeout=120)
    text = " ".join(out.stdout.split())
    for needle in ("--rollout", "group or tree", "--tree-trigger", "tool_call or tokens", "--tree-advantage",
                   "grpo or siblings", "--tree-leaves", "--tree-every"):
        assert needle in text
