"""The trainer's sampler on an agent task: the environment is called from the rollout, its observation tokens are
in the group masked from the loss, the turns are counted, and the group trains."""

from __future__ import annotations

import torch

from longstraw import backward_group, load_model
from longstraw.distributed.runtime import Parallel
from longstraw.models.tokenizer import load_tokenizer
from longstraw.tasks.lookup import LookupTask
from longstraw.train.config import TrainConfig
from longstraw.train.data import TaskData
from longstraw.train.reporting import Progress, StepLog
from longstraw.train.sampler import Sampler


def test_the_trainers_sampler_runs_multi_turn_rollouts(monkeypatch, tmp_path):
    """A random-init tiny model never writes "</lookup>", so the call's closing token is set to the byte it writes
    most often and the environment answers every call with a fixed result, the reward by length: this exercises
    the trainer's plumbing (calls, masks, turns, the gradient), not what the model learns."""
    cfg = TrainConfig.from_flat(model="tiny-llama", task="lookup", prompt_tokens=500, group_size=4, max_new_tokens=48,
                                top_k=4, max_turns=3, run_dir=str(tmp_path / "run"))
    tokenizer = load_tokenizer("tiny-llama")
    model = load_model("tiny-llama").eval()
    data = TaskData(cfg, tokenizer, max_positions=2048)
    free = Sampler(cfg, data, (), None, Parallel()).rollout(model, 0, 0, data.examples(0)[0])
    frequent = int(torch.cat(free.group.responses).bincount().argmax())
    monkeypatch.setattr(TaskData, "call_end", property(lambda self: (frequent,)))
    monkeypatch.setattr(LookupTask, "observe", lambda self, response, example: "<result>phone: 1234</result>")
    monkeypatch.setattr(LookupTask, "reward", lambda self, completion, example: float(len(completion) % 3))
    sampler = Sampler(cfg, data, (), None, Parallel())
    log = StepLog("cpu")
    groups = sampler.step_groups(model, 0, Progress(cfg.optimizer.steps, enabled=False), log)
    (scored,) = groups
    masks = scored.group.loss_masks
    observation = tokenizer.encode("<result>phone: 1234</result>", add_special_tokens=False)
    assert masks is not None and any(bool((~m).any()) for m in masks)
    for response, mask in zip(scored.group.responses, masks):
        assert bool(mask[0])
        observed = response[~mask].tolist()
        assert len(observed) % len(observation) == 0 and observed == observation * (len(observed) // len(observation))
    assert scored.turns > cfg.rollout.group_size and log.observation_tokens == sum(int((~m).sum()) for m in masks)
    assert scored.tool_calls >= scored.turns - cfg.rollout.group_size and log.tool_calls == scored.tool_calls
    row = log.row(Parallel(), 0, n_kept=1, skipped=0, loss=0.0, grad_norm=0.0, lr=0.0, bias_metrics={})
    assert (row["turns"], row["tool_calls"], row["observation_tokens"]) == (scored.turns, scored.tool_calls,
                                                                           log.observation_tokens)
    assert row["turns_mean"] == scored.turns / cfg.rollout.group_size
    assert row["tool_calls_mean"] == scored.tool_calls / cfg.rollout.group_size
    backward_group(model, scored.group, plan="exact", chunk_size=cfg.plan.chunk_size, prompt_state=scored.state)
    assert any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())


def test_the_trainers_environment_answers_an_id_of_any_length(tmp_path):
    """A policy that writes a 5,000-digit id (past Python's int(str) limit) gets "no person" as token ids the model
    can read, and a reward of 0: the run goes on."""
    cfg = TrainConfig.from_flat(model="tiny-llama", task="lookup", prompt_tokens=500, group_size=2, max_new_tokens=48,
                                max_turns=3, run_dir=str(tmp_path / "run"))
    tokenizer = load_tokenizer("tiny-llama")
    data = TaskData(cfg, tokenizer, max_positions=2048)
    example = data.examples(0)[0]
    written = "<lookup>" + "7" * 5000 + "</lookup>"
    observation = data.environment(example)(0, torch.tensor(tokenizer.encode(written, add_special_tokens=False)))
    assert observation is not None and observation.dtype == torch.long and observation.dim() == 1
    assert "no person has id 777777777777... (5000 digits)" in data.decode(observation)
    assert data.reward(written + "<answer>" + "7" * 5000 + "</answer>", example, "step 1") == 0.0
