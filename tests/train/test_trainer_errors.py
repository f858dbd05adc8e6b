"""The trainer's error paths: data checked before step 1, failures and signals after step 1 save the last
completed step (never a half-done one), one line without a traceback (``--debug`` shows it)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import train_child

from longstraw.train.checkpoints import load_checkpoint
from longstraw.train.config import TrainConfig
from longstraw.train.stopping import StopSignals, TrainingInterrupted
from longstraw.train.trainer import Trainer


def _data(tmp: Path, extra: list[str] = ()) -> Path:
    path = tmp / "data.jsonl"
    rows = [json.dumps({"prompt": f"Say something about {w}.", "answer": w}) for w in ("cats", "rain", "maps")]
    path.write_text("\n".join([*rows, *extra]) + "\n")
    return path


def _common(data: Path, reward: str, steps: int = 6) -> list[str]:
    return ["train", "--model", "tiny-llama", "--task", "jsonl", "--data", str(data), "--reward-fn", reward,
            "--group-size", "3", "--max-new-tokens", "4", "--lr", "1e-3", "--eval-prompts", "0", "--no-plot",
            "--chunk-size", "8", "--steps", str(steps)]


def _steps(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_jsonl_row_is_checked_before_step_1(tmp_path):
    """Row 4 does not fit tiny-llama's 2048 positions: refused when the trainer is built, naming file and line."""
    data = _data(tmp_path, [json.dumps({"prompt": "word " * 500, "answer": "x"})])
    cfg = TrainConfig.from_flat(model="tiny-llama", task="jsonl", data=str(data), max_new_tokens=8, eval_prompts=0,
                                plot=False, run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match=rf"{data}:4: prompt of 2500 tokens \+ 8 new tokens exceeds the 2048 "
                                         "positions of model 'tiny-llama'"):
        Trainer(cfg)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"prompt": "hi", "answer": "x"}) + "\n" + json.dumps({"prompt": " ", "answer": "x"}))
    with pytest.raises(ValueError, match=rf"{empty}:2: empty prompt"):
        Trainer(TrainConfig.from_flat({**cfg.to_flat(), "data": str(empty)}))


def test_a_generated_prompt_too_long_for_the_model_is_refused_before_step_1(tmp_path):
    cfg = TrainConfig.from_flat(model="tiny-llama", task="passkey", prompt_tokens=4096, eval_prompts=0, plot=False,
                                run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="exceeds the 2048 positions of model 'tiny-llama': lower --prompt-tokens"):
        Trainer(cfg)


def test_a_raising_reward_function_saves_the_last_completed_step(tmp_path):
    """The reward function raises in step 4: one line naming it and the step, a checkpoint of step 3 equal to
    a run stopped after step 3, exit status 1, no traceback; --debug adds the traceback."""
    data = _data(tmp_path)
    common = _common(data, "rewards_for_tests:raises_on_call_10")
    run, ref = tmp_path / "run", tmp_path / "ref"
    code = train_child.run([*common, "--run-dir", str(run)], tmp_path / "log")
    log = (tmp_path / "log").read_text()
    assert code == 1, log
    assert ("error: step 4: the reward function 'rewards_for_tests:raises_on_call_10' raised ZeroDivisionError: "
            "division by zero") in log
    assert f"saved the last completed step (3) to {run / 'checkpoint.pt'}; continue with --resume" in log
    assert "Traceback" not in log
    assert _steps(run) == [1, 2, 3]
    assert train_child.run([*common, "--stop-after", "3", "--run-dir", str(ref)], tmp_path / "log-ref") == 0
    got, want = load_checkpoint(run), load_checkpoint(ref)
    assert got["step"] == want["step"] == 3
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
    assert json.dumps(got["optimizer"]["param_groups"]) == json.dumps(want["optimizer"]["param_groups"])
    assert all(torch.equal(got["optimizer"]["state"][i]["exp_avg_sq"], want["optimizer"]["state"][i]["exp_avg_sq"])
               for i in want["optimizer"]["state"])

    code = train_child.run([*common, "--run-dir", str(tmp_path / "dbg"), "--debug"], tmp_path / "log-dbg")
    log = (tmp_path / "log-dbg").read_text()
    assert code == 1 and "Traceback" in log and "ZeroDivisionError" in log


def test_a_nan_reward_names_the_function_and_step(tmp_path):
    run = tmp_path / "run"
    code = train_child.run([*_common(_data(tmp_path), "rewards_for_tests:nan_on_call_4"), "--run-dir", str(run)],
                           tmp_path / "log")
    log = (tmp_path / "log").read_text()
    assert code == 1 and "Traceback" not in log, log
    assert "error: step 2: reward function 'rewards_for_tests:nan_on_call_4' returned nan" in log
    assert load_checkpoint(run)["step"] == 1 and _steps(run) == [1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_the_last_completed_step(tmp_path, sig):
    run = tmp_path / "run"
    log = tmp_path / "log"
    proc = train_child.start([*_common(_data(tmp_path), "rewards_for_tests:even_byte_fraction", steps=10_000),
                              "--run-dir", str(run)], log)
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").exists() and len(_steps(run)) >= 2):
        assert proc.is_alive() and time.monotonic() < deadline, log.read_text()
        time.sleep(0.005)
    os.kill(proc.pid, sig)
    proc.join(60)
    text = log.read_text()
    assert proc.exitcode == 128 + sig, text
    name = signal.Signals(sig).name
    assert f"stopped by {name}" in text and "Traceback" not in text
    saved = load_checkpoint(run)["step"]
    assert f"saved the last completed step ({saved})" in text
    assert _steps(run) == list(range(1, saved + 1))  # the checkpoint is the last step that has a metrics row


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_a_failure_after_the_weights_changed_is_not_saved(tmp_path, capsys):
    """num_iterations = 2: a failure after step 2's first optimizer step leaves a half-done state; the
    checkpoint of step 1 stays, and the message says why nothing newer was saved."""
    cfg = TrainConfig.from_flat(
        model="tiny-llama", task="jsonl", data=str(_data(tmp_path)), reward_fn="rewards_for_tests:even_byte_fraction",
        group_size=3, max_new_tokens=4, steps=3, num_iterations=2, save_every=1, lr=1e-3, eval_prompts=0, plot=False,
        run_dir=str(tmp_path / "r"))
    trainer = Trainer(cfg)
    real_step, calls = trainer.optimizer.step, []

    def step_then_fail(*args, **kwargs):
        real_step(*args, **kwargs)
        calls.append(1)
        if len(calls) == 3:  # step 2, first of its two updates
            raise RuntimeError("injected failure between the two updates")

    trainer.optimizer.step = step_then_fail
    with pytest.raises(RuntimeError, match="injected failure"):
        trainer.run()
    err = capsys.readouterr().err
    assert ("step 2 had already changed the weights when it failed, so it is not saved; the last checkpoint, "
            f"step 1, is {tmp_path / 'r' / 'checkpoint.pt'}") in err
    assert load_checkpoint(tmp_path / "r")["step"] == 1


def test_a_signal_during_an_update_is_held_until_the_step_ends():
    before = signal.getsignal(signal.SIGTERM)
    state = {"busy": True}
    with StopSignals(busy=lambda: state["busy"], describe=lambda: "finishing") as signals:
        os.kill(os.getpid(), signal.SIGTERM)  # held: the handler returns
        assert signals.pending == signal.SIGTERM
        state["busy"] = False
        with pytest.raises(TrainingInterrupted) as err:
            signals.check()
        assert err.value.signum == signal.SIGTERM
        with pytest.raises(TrainingInterrupted):  # not busy: raised at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


def test_rewards_too_large_to_normalise_are_the_rewards_fault(tmp_path, capsys):
    """Rewards of +-1e308 are finite, but grpo's standard deviation of them is not: the error names the rewards of
    the group and the reward function's scale, not the advantages they would have produced."""
    from longstraw import cli

    run = tmp_path / "run"
    assert cli.main([*_common(_data(tmp_path), "rewards_for_tests:huge_alternating", steps=1), "--run-dir",
                     str(run)]) == 1
    err = capsys.readouterr().err
    assert ("error: step 1: rewards of group 1 are too large to normalise: [1e+308, -1e+308, 1e+308] (their grpo "
            "advantages overflow float64 on the way); scale the reward function's values down") in err
    assert "advantages contains NaN or inf" not in err and "Traceback" not in err


@pytest.mark.parametrize("advantage, rewards, why", [
    ("grpo", [1e200, 0.0, 0.0], "overflow float64 on the way"),  # std = inf: every advantage would be a silent 0
    ("rloo", [1e30, 0.0, 0.0], "reach 1e+30, beyond the 1.84e+19 the loss can hold in float32"),
])
def test_rewards_whose_advantages_overflow_are_refused(advantage, rewards, why):
    from longstraw.train.data import RewardError
    from longstraw.train.sampler import group_advantages

    r = torch.tensor(rewards, dtype=torch.float64)
    with pytest.raises(RewardError, match=rf"rewards of group 1 are too large to normalise: .*{re.escape(why)}"):
        group_advantages(r, advantage, torch.float32, "step 2: rewards of group 1")
    small = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    group_advantages(small, advantage, torch.float32, "step 2")
