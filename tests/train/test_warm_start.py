"""The supervised warm start (`train/warmup.py`): nll steps on the lookup task's gold trajectories before GRPO, then
the held-out reward and tool-call rate after it; its options refused early."""

from __future__ import annotations

import json

import pytest
import torch

from longstraw import load_model
from longstraw.models.tokenizer import load_tokenizer
from longstraw.train.config import TrainConfig
from longstraw.train.data import TaskData
from longstraw.train.trainer import Trainer
from longstraw.train.warmup import gold_group, warm_start, warm_start_examples

TINY = dict(model="tiny-llama", task="lookup", prompt_tokens=600, max_new_tokens=128, group_size=2, chunk_size=256)


def _nll(model, group) -> float:
    """The gold response's mean nll under `model` (a plain forward, observations masked)."""
    with torch.no_grad():
        response = group.responses[0]
        logits = model(torch.cat([group.prompt, response])[None]).logits[0, group.prompt.numel() - 1: -1]
        logp = torch.log_softmax(logits.double(), -1).gather(-1, response[:, None]).squeeze(-1)
        mask = group.loss_masks[0]
        return float(-(logp * mask).sum() / mask.sum())


def test_the_warm_start_lowers_the_gold_nll(tmp_path):
    """Four warm-start steps lower the nll of a gold response of a prompt it never trained on (the protocol's
    tokens are shared by every prompt), and the recorded per-step losses are the nll of what it trained on."""
    cfg = TrainConfig.from_flat(TINY, warm_start_steps=4, warm_start_batch=2, warm_start_lr=3e-3, run_dir=str(tmp_path))
    model = load_model("tiny-llama").eval()
    data = TaskData(cfg, load_tokenizer("tiny-llama"), max_positions=2048)
    held = gold_group(data, data.held_out()[0], (256,))
    first = gold_group(data, warm_start_examples(cfg, data, 0)[0], (256,))
    before, first_before = _nll(model, held), _nll(model, first)
    record = warm_start(model, cfg, data, cfg.plan.backward_options(), (256,), note=lambda text: None)
    after = _nll(model, held)
    assert record["steps"] == 4 and len(record["nll"]) == 4
    assert record["nll"][0] == pytest.approx((first_before + _nll(load_model("tiny-llama").eval(), gold_group(
        data, warm_start_examples(cfg, data, 0)[1], (256,)))) / 2, rel=1e-4)
    assert after < 0.9 * before, (before, after)  # 6.22 -> 4.98 measured


def test_a_run_with_a_warm_start_reports_the_three_evaluations(tmp_path):
    cfg = TrainConfig.from_flat(
        TINY, warm_start_steps=2, warm_start_batch=1, warm_start_lr=1e-3, steps=1, eval_prompts=1, max_turns=2,
        plot=False, run_dir=str(tmp_path / "run"))
    summary = Trainer(cfg).run()
    for key in ("eval_before", "eval_after_warm_start", "eval_after", "tool_call_rate_before",
                "tool_call_rate_after_warm_start", "tool_call_rate_after"):
        assert key in summary and 0.0 <= summary[key] <= 1.2, key
    assert len(summary["warm_start"]["nll"]) == 2 and summary["steps"] == 1
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["warm_start"]["steps"] == 2


@pytest.mark.parametrize("options,match", [
    (dict(task="passkey", warm_start_steps=2), "task 'passkey' writes none: use --task lookup"),
    (dict(warm_start_steps=-1), "warm_start_steps must be >= 0"),
    (dict(warm_start_steps=1, warm_start_batch=0), "warm_start_batch must be >= 1"),
    (dict(warm_start_steps=1, warm_start_lr=float("inf")), "warm_start_lr must be a finite number > 0"),
])
def test_bad_warm_start_options_are_refused(options, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flat({**TINY, "task": "lookup", **options}, run_dir=str(tmp_path))


def test_a_gold_response_longer_than_max_new_tokens_is_refused_before_training(tmp_path):
    cfg = TrainConfig.from_flat({**TINY, "max_new_tokens": 40}, warm_start_steps=1, eval_prompts=1,
                                run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"gold response has \d+ tokens .* raise --max-new-tokens to at least \d+"):
        Trainer(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
