"""The trainer with 2 ranks: data parallel over 4 prompts per step equals one process (metrics, weights,
optimizer state, same checkpoint format); a rank that raises mid-step stops every rank with its message;
launch errors say what to change."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import FP32_RANKS, assert_close

import longstraw
from longstraw.cli import main
from longstraw.distributed.runtime import Parallel

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
SRC = Path(longstraw.__file__).resolve().parents[1]  # the children import the longstraw this process tests


def _data(tmp_path: Path) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say something about {w}.", "answer": w}) + "\n"
                            for w in ("cats", "rain", "maps", "tea", "snow", "bread")))
    return path


def _common(tmp_path: Path, reward: str = "rewards_for_tests:even_byte_fraction") -> list[str]:
    return ["--model", "tiny-llama", "--task", "jsonl", "--data", str(_data(tmp_path)), "--reward-fn", reward,
            "--group-size", "4", "--max-new-tokens", "6", "--lr", "1e-3", "--eval-prompts", "2", "--no-plot",
            "--chunk-size", "8", "--prompts-per-step", "4", "--plan", "exact"]


def _cli(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(HERE), str(SRC)]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "longstraw.cli", "train", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def _flat(sd: dict) -> torch.Tensor:
    return torch.cat([sd[k].flatten().double() for k in sorted(sd)])


@pytest.mark.slow
def test_two_ranks_with_four_prompts_equal_one_process(tmp_path):
    one = _cli([*_common(tmp_path), "--steps", "2", "--run-dir", str(tmp_path / "one")], tmp_path)
    assert one.returncode == 0, one.stderr
    two = _cli([*_common(tmp_path), "--steps", "2", "--run-dir", str(tmp_path / "two"), "--nproc", "2"], tmp_path)
    assert two.returncode == 0, two.stderr
    a = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [1, 2]  # rank 0 alone wrote the metrics, once per step
    for x, y in zip(a, b):
        # the same 4 prompts and the same 16 samples (rewards of all ranks), the same global gradient
        assert x["reward_mean"] == y["reward_mean"] and x["reward_std"] == y["reward_std"]
        assert x["kept_groups"] == y["kept_groups"] == 4
        assert x["response_tokens_mean"] == y["response_tokens_mean"]
        assert x["grad_norm"] > 0 and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5 * x["grad_norm"]
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert sa["eval_before"] == sb["eval_before"] and sa["eval_after"] == sb["eval_after"]
    ca = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)
    cb = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=False)
    assert sorted(ca["model"]) == sorted(cb["model"])  # one checkpoint format, whatever the process count
    assert_close("weights after 2 steps", _flat(ca["model"]), _flat(cb["model"]), FP32_RANKS)
    oa, ob = ca["optimizer"], cb["optimizer"]
    assert sorted(oa["state"]) == sorted(ob["state"]) and oa["param_groups"] == ob["param_groups"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert_close(f"AdamW {key}", _flat({i: oa["state"][i][key] for i in oa["state"]}),
                     _flat({i: ob["state"][i][key] for i in ob["state"]}), FP32_RANKS)


def test_a_rank_that_raises_stops_every_rank_with_its_message(spawn, tmp_path):
    args = ["-m", "longstraw.cli", "train", *_common(tmp_path, "failing_reward:fail_on_rank_1_in_step_2"),
            "--eval-prompts", "0", "--steps", "3", "--run-dir", str(tmp_path / "run")]
    start = time.monotonic()
    results = spawn(args, world=2, timeout=240, cwd=tmp_path)
    assert time.monotonic() - start < 240
    message = "reward service unreachable (injected failure)"
    for rank, (code, out) in enumerate(results):
        assert code != 0, f"rank {rank} exited 0:\n{out}"
        assert message in out, f"rank {rank} does not report the failing rank's error:\n{out}"
    assert ("rank 0 stops because rank 1 failed: RewardError: step 2: the reward function "
            "'failing_reward:fail_on_rank_1_in_step_2' raised RuntimeError: " + message) in results[0][1]
    rows = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1  # step 1 completed, the failure came mid-run


@pytest.mark.slow
def test_launcher_reports_the_failing_rank(tmp_path):
    out = _cli([*_common(tmp_path, "failing_reward:fail_on_rank_1_in_step_2"), "--eval-prompts", "0",
                "--steps", "3", "--run-dir", str(tmp_path / "run"), "--nproc", "2"], tmp_path, timeout=240)
    assert out.returncode == 1
    text = out.stdout + out.stderr
    assert "reward service unreachable (injected failure)" in text and "a rank failed" in text


def test_launch_errors_say_what_to_change(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--prompts-per-step", "3", "--nproc", "2"])
    assert exc.value.code == 2
    assert "--prompts-per-step 3 cannot be split evenly over 2 data-parallel groups" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--device", "cuda", "--nproc", str(max(2, torch.cuda.device_count() + 1))])
    err = capsys.readouterr().err
    if torch.cuda.is_available():
        assert "GPUs (one per process) but this machine has" in err
    else:  # the config's device check comes first
        assert "device 'cuda': no CUDA GPU is available" in err


def test_ranks_take_contiguous_prompt_slices():
    assert [Parallel(rank=r, world_size=2).share(4) for r in (0, 1)] == [range(0, 2), range(2, 4)]
    assert Parallel().share(3) == range(0, 3)
    with pytest.raises(ValueError, match="prompts_per_step = 6 cannot be split evenly over 4 data-parallel"):
        Parallel(rank=0, world_size=4).share(6)
    # --cp 2 over 4 ranks: ranks 0, 1 share the first half of the prompts, ranks 2, 3 the second
    assert [Parallel(rank=r, world_size=4, cp_size=2).share(4) for r in range(4)] == [
        range(0, 2), range(0, 2), range(2, 4), range(2, 4)]


@pytest.mark.slow
def test_resume_with_another_process_count(tmp_path):
    """2 ranks stop after step 2, one process resumes to step 3 (and the reverse): same as a straight run."""
    common = [*_common(tmp_path), "--eval-prompts", "0", "--steps", "3", "--beta", "0.1"]
    assert _cli([*common, "--run-dir", str(tmp_path / "straight")], tmp_path).returncode == 0
    for name, first, then in (("a", ["--nproc", "2"], []), ("b", [], ["--nproc", "2"])):
        run = ["--run-dir", str(tmp_path / name)]
        out = _cli([*common, *run, "--stop-after", "2", *first], tmp_path)
        assert out.returncode == 0, out.stderr
        out = _cli([*common, *run, "--resume", *then], tmp_path)
        assert out.returncode == 0, out.stderr
        a = [json.loads(x) for x in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
        b = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]
        wa = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)["model"]
        wb = torch.load(tmp_path / name / "checkpoint.pt", weights_only=False)["model"]
        assert_close("weights", _flat(wa), _flat(wb), FP32_RANKS)


@pytest.mark.slow
def test_context_parallel_trainer_equals_one_process(tmp_path):
    """--nproc 2 --cp 2: both ranks share every prompt's state (each holds half its K/V); the run equals one
    process: same samples, same gradient, same weights."""
    one = _cli([*_common(tmp_path), "--steps", "2", "--run-dir", str(tmp_path / "one")], tmp_path)
    assert one.returncode == 0, one.stderr
    two = _cli([*_common(tmp_path), "--steps", "2", "--run-dir", str(tmp_path / "cp"), "--nproc", "2", "--cp", "2"],
               tmp_path)
    assert two.returncode == 0, two.stderr
    a = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "cp" / "metrics.jsonl").read_text().splitlines()]
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["kept_groups"] == y["kept_groups"] == 4
        assert x["grad_norm"] > 0 and abs(x["grad_norm"] - y["grad_norm"]) <= 1e-5 * x["grad_norm"]
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "cp"))
    assert sa["eval_before"] == sb["eval_before"] and sa["eval_after"] == sb["eval_after"]
    ca = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)
    cb = torch.load(tmp_path / "cp" / "checkpoint.pt", weights_only=False)
    assert_close("weights after 2 steps", _flat(ca["model"]), _flat(cb["model"]), FP32_RANKS)


def test_cp_that_does_not_divide_the_processes_is_refused(tmp_path):
    out = _cli([*_common(tmp_path), "--steps", "1", "--run-dir", str(tmp_path / "r"), "--nproc", "2", "--cp", "3"],
               tmp_path)
    assert out.returncode == 2 and "--cp 3 needs --nproc to be a multiple of 3" in out.stderr
