"""The trainer end to end: the smoke command, exact resume, checkpoint errors, non-finite guard."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import jsonl_dataset

import longstraw
from longstraw.train.config import TrainConfig
from longstraw.train.reporting import Progress
from longstraw.train.trainer import Trainer

TESTS = Path(__file__).parents[1]  # tests/: the reward modules the children import
SRC = Path(longstraw.__file__).resolve().parents[1]  # the children import the longstraw this process tests


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(SRC)]))
    return subprocess.run([sys.executable, "-m", "longstraw.cli", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def test_smoke_command_writes_metrics_and_checkpoint(tmp_path):
    run = tmp_path / "run"
    out = _cli("train", "--model", "tiny-qwen3", "--task", "passkey", "--prompt-tokens", "256", "--group-size", "4",
               "--steps", "2", "--run-dir", str(run), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert {"step", "reward_mean", "loss", "peak_memory_bytes"} <= set(r)
        assert r["peak_memory_bytes"] > 0 and 200 < r["prompt_tokens"] < 320
    assert (run / "checkpoint.pt").is_file() and (run / "progress.png").is_file()
    summary = json.loads((run / "summary.json").read_text())
    assert "eval_before" in summary and "eval_after" in summary
    assert "step 2/2" in out.stdout and "held-out greedy reward" in out.stdout


def _jsonl(tmp_path: Path) -> Path:
    return jsonl_dataset(tmp_path)


@pytest.mark.slow
def test_resume_in_a_fresh_process_equals_a_straight_run(tmp_path):
    common = ["--model", "tiny-llama", "--task", "jsonl", "--data", str(_jsonl(tmp_path)),
              "--reward-fn", "rewards_for_tests:even_byte_fraction", "--group-size", "4", "--max-new-tokens", "6",
              "--lr", "1e-3", "--eval-prompts", "0", "--no-plot", "--chunk-size", "8", "--lr-schedule", "cosine"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert _cli("train", *common, "--steps", "6", "--run-dir", str(straight), cwd=tmp_path).returncode == 0
    first = _cli("train", *common, "--steps", "6", "--stop-after", "3", "--run-dir", str(split), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    second = _cli("train", *common, "--steps", "6", "--run-dir", str(split), "--resume", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    a = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    assert "stopped after step 3" in first.stdout and "resumed from" in second.stdout
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert any(r["grad_norm"] > 0 for r in a)  # the run really trained
    for x, y in zip(a, b):
        assert x["loss"] == y["loss"] and x["reward_mean"] == y["reward_mean"]
    wa = torch.load(straight / "checkpoint.pt", weights_only=False)["model"]
    wb = torch.load(split / "checkpoint.pt", weights_only=False)["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_errors(tmp_path):
    cfg = TrainConfig.from_flat(run_dir=str(tmp_path / "none"), resume=True, steps=1, eval_prompts=0, plot=False)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Trainer(cfg).run()
    run = tmp_path / "bad"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"PK\x03\x04 truncated")
    cfg = TrainConfig.from_flat(run_dir=str(run), resume=True, steps=1, eval_prompts=0, plot=False)
    with pytest.raises(ValueError, match="damaged or truncated"):
        Trainer(cfg).run()


def test_non_finite_gradient_stops_before_the_optimizer(tmp_path):
    cfg = TrainConfig.from_flat(
        model="tiny-llama", prompt_tokens=64, group_size=3, max_new_tokens=4, steps=1, eval_prompts=0, plot=False,
        run_dir=str(tmp_path), task="jsonl", data=str(_jsonl(tmp_path)),
        reward_fn="rewards_for_tests:even_byte_fraction")
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    # A NaN gradient (as from an fp16 overflow) on one weight must stop the step before AdamW runs.
    trainer.model.get_output_embeddings().weight.register_hook(lambda g: g * float("nan"))
    with pytest.raises(FloatingPointError, match="weights are unchanged"):
        trainer.train_step(0, Progress(1))
    after = trainer.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_an_update_that_would_make_weights_non_finite_is_not_applied(tmp_path):
    """Finite gradients, but an AdamW update that overflows float32 (lr 1e39): refused before it is applied,
    with the weights and the optimizer state (moments, step counts) those of the previous step."""
    cfg = TrainConfig.from_flat(model="tiny-llama", group_size=3, max_new_tokens=4, steps=2, eval_prompts=0, plot=False,
                                run_dir=str(tmp_path), task="jsonl", data=str(_jsonl(tmp_path)),
                                reward_fn="rewards_for_tests:even_byte_fraction", lr=1e-3)
    trainer = Trainer(cfg)
    first = trainer.train_step(0, Progress(2))
    assert first["grad_norm"] > 0
    weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    moments = [{k: v.clone() for k, v in s.items()} for s in trainer.optimizer.state.values()]
    for group in trainer.optimizer.param_groups:
        group["lr"] = 1e39
    with pytest.raises(FloatingPointError, match=r"step 2: the AdamW update would make .* non-finite; it was not "
                                                 r"applied: the weights and optimizer state are as they were"):
        trainer.train_step(1, Progress(2))
    assert all(torch.equal(weights[k], v) for k, v in trainer.model.state_dict().items())
    after = list(trainer.optimizer.state.values())
    assert len(after) == len(moments) and all(
        torch.equal(a[k], b[k]) for a, b in zip(after, moments) for k in b)
    # Should a step ever do what the check did not foresee, the weights are checked again after it.
    for group in trainer.optimizer.param_groups:
        group["lr"] = 1e-3
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: (step(), trainer.model.get_output_embeddings().weight.data[0, 0].fill_(math.nan))
    with pytest.raises(FloatingPointError, match="after the AdamW step, lm_head.weight holds non-finite values"):
        trainer.train_step(1, Progress(2))


def test_zero_advantage_groups_are_skipped_and_logged(tmp_path):
    """Rewards all equal (exact-match reward, random model: all 0): advantages 0, beta 0, so the gradient pass
    is skipped and counted; AdamW still takes its (zero-gradient) step, as it did before skipping existed."""
    cfg = TrainConfig.from_flat(model="tiny-llama", group_size=3, prompts_per_step=2, max_new_tokens=4, steps=1,
                                eval_prompts=0, plot=False, run_dir=str(tmp_path / "r"), task="jsonl",
                                data=str(_jsonl(tmp_path)))
    trainer = Trainer(cfg)
    m = trainer.train_step(0, Progress(1))
    assert m["reward_max"] == 0.0 and m["kept_groups"] == 2
    assert m["skipped_zero_advantage"] == 2 and m["loss"] == 0.0 and m["grad_norm"] == 0.0
    assert all(int(s["step"]) == 1 for s in trainer.optimizer.state.values())
    assert len(trainer.optimizer.state) == len(list(trainer.model.parameters()))


def test_bad_command_line_is_an_argparse_error(tmp_path):
    out = _cli("train", "--group-size", "1", "--run-dir", str(tmp_path / "r"), cwd=tmp_path)
    assert out.returncode == 2 and "group_size 1 is too small" in out.stderr and "Traceback" not in out.stderr


def test_kl_reuse_and_dynamic_sampling_run_and_report(tmp_path):
    """beta > 0 (frozen reference scored from its own capture), two updates per rollout, and DAPO-style
    dropping of equal-reward groups, in one short run."""
    data = _jsonl(tmp_path)
    cfg = TrainConfig.from_flat(
        model="tiny-llama", task="jsonl", data=str(data), reward_fn="rewards_for_tests:even_byte_fraction",
        group_size=3, prompts_per_step=2, max_new_tokens=4, steps=2, beta=0.1, num_iterations=2, dynamic_sampling=True,
        loss="dapo", lr=1e-3, eval_prompts=0, plot=False, run_dir=str(tmp_path / "r"))
    trainer = Trainer(cfg)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    m = trainer.train_step(0, Progress(2))
    assert m["kept_groups"] + m["dropped_groups"] == 2 and math.isfinite(m["loss"])
    ref = list(trainer.reference.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, ref))  # the reference stays frozen
    assert m["kept_groups"] >= 1  # this seed keeps a group, so the step must move the weights
    assert any(not torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))

    # A reward that is the same for every response: every group is dropped and nothing is updated.
    cfg2 = TrainConfig.from_flat({**cfg.to_flat(), "reward_fn": "", "beta": 0.0, "run_dir": str(tmp_path / "r2")})
    trainer2 = Trainer(cfg2)
    m2 = trainer2.train_step(0, Progress(1))
    assert m2["dropped_groups"] == 2 and m2["kept_groups"] == 0 and m2["grad_norm"] == 0.0


@pytest.mark.slow
def test_checkpointing_and_offload_train_like_the_plain_run(tmp_path):
    """`--checkpoint-layers --offload-state` (the memory levers) change no metric and no weight of a 3-step run.
    float64: the plain run reads its coalesced prefix in one attention call, the offloaded one chunk by chunk (sums
    associated differently), which AdamW's normalised steps would lift above a tight tolerance in fp32."""
    common = ["--model", "tiny-llama", "--dtype", "float64", "--task", "jsonl", "--data", str(_jsonl(tmp_path)),
              "--reward-fn", "rewards_for_tests:even_byte_fraction", "--group-size", "4", "--max-new-tokens", "6",
              "--lr", "1e-3", "--eval-prompts", "0", "--no-plot", "--chunk-size", "8", "--steps", "3"]
    plain, lean = tmp_path / "plain", tmp_path / "lean"
    assert _cli("train", *common, "--run-dir", str(plain), cwd=tmp_path).returncode == 0
    out = _cli("train", *common, "--checkpoint-layers", "--offload-state", "--run-dir", str(lean), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    a = [json.loads(x) for x in (plain / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (lean / "metrics.jsonl").read_text().splitlines()]
    assert len(a) == len(b) == 3 and any(r["grad_norm"] > 0 for r in a)
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["loss"] == pytest.approx(y["loss"], rel=1e-9, abs=1e-12)
    wa = torch.load(plain / "checkpoint.pt", weights_only=False)["model"]
    wb = torch.load(lean / "checkpoint.pt", weights_only=False)["model"]
    for k in wa:
        assert float((wa[k] - wb[k]).norm()) <= 1e-10 * max(1.0, float(wa[k].norm())), k
    bad = _cli("train", *common, "--plan", "standard", "--offload-state", "--run-dir", str(tmp_path / "x"),
               cwd=tmp_path)
    assert bad.returncode == 2 and "offload_state moves the prompt state" in bad.stderr
