"""`longstraw train --tp`: tensor parallelism from the trainer, alone, with FSDP2 (--nproc 4 --tp 2: a 2-D mesh) and
with context parallelism (--tp 2 --cp 2), each equal to one process after two steps; and the process counts and
models it cannot serve, refused before anything is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FP32_RANKS, assert_close

import longstraw
from longstraw.distributed.launch import check_nproc

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
SRC = Path(longstraw.__file__).resolve().parents[1]


def _cli(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(HERE), str(SRC)]))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "longstraw.cli", "train", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def _common(tmp_path: Path) -> list[str]:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Say something about {w}.", "answer": w}) + "\n"
                            for w in ("cats", "rain", "maps", "tea", "snow", "bread")))
    return ["--model", "tiny-llama", "--task", "jsonl", "--data", str(data), "--reward-fn",
            "rewards_for_tests:even_byte_fraction", "--group-size", "4", "--max-new-tokens", "6", "--lr", "1e-3",
            "--eval-prompts", "2", "--no-plot", "--chunk-size", "8", "--prompts-per-step", "4", "--plan", "exact",
            "--steps", "2"]


def _flat(sd: dict) -> torch.Tensor:
    return torch.cat([sd[k].flatten().double() for k in sorted(sd)])


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--nproc", "2", "--tp", "2"], ["--nproc", "4", "--tp", "2"],
                                    ["--nproc", "4", "--tp", "2", "--cp", "2"]], ids=["tp2", "fsdp2xtp2", "tp2xcp2"])
def test_train_with_tensor_parallelism_equals_one_process(tmp_path, layout):
    """float32, 2 steps: the same samples and rewards, the same gradient norm and the same weights after the steps
    (within float32 reductions across ranks), the checkpoint in the single-process format."""
    one = _cli([*_common(tmp_path), "--run-dir", str(tmp_path / "one")], tmp_path)
    assert one.returncode == 0, one.stderr
    many = _cli([*_common(tmp_path), "--run-dir", str(tmp_path / "many"), *layout], tmp_path)
    assert many.returncode == 0, many.stderr
    a = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "many" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b):
        assert x["reward_mean"] == y["reward_mean"] and x["kept_groups"] == y["kept_groups"] == 4
        assert x["grad_norm"] > 0 and abs(x["grad_norm"] - y["grad_norm"]) <= FP32_RANKS * x["grad_norm"]
    sa, sb = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "many"))
    assert sa["eval_before"] == sb["eval_before"]
    ca = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)
    cb = torch.load(tmp_path / "many" / "checkpoint.pt", weights_only=False)
    assert sorted(ca["model"]) == sorted(cb["model"])  # full tensors, gathered from the shards
    assert_close("weights after 2 steps", _flat(ca["model"]), _flat(cb["model"]), FP32_RANKS)


def test_process_counts_that_tensor_parallelism_cannot_split_are_refused():
    with pytest.raises(ValueError, match="--tp 2 x --cp 2 needs --nproc to be a multiple of 4"):
        check_nproc(2, "cpu", 4, cp=2, tp=2)
    with pytest.raises(ValueError, match="data-parallel groups"):
        check_nproc(6, "cpu", 4, cp=1, tp=2)  # 3 blocks of 2 ranks cannot split 4 prompts
    check_nproc(4, "cpu", 4, cp=2, tp=2)


@pytest.mark.slow
def test_train_refuses_a_model_it_cannot_split_by_heads(tmp_path):
    """tiny-qwen3 has one key/value head: --tp 2 is refused with the reason, by the launcher before any rank starts."""
    run = _cli([*_common(tmp_path), "--model", "tiny-qwen3", "--run-dir", str(tmp_path / "r"), "--nproc", "2",
                "--tp", "2", "--steps", "1"], tmp_path, timeout=300)
    assert run.returncode != 0 and "1 key/value heads" in run.stderr + run.stdout


@pytest.mark.slow
def test_resume_a_one_process_run_with_tensor_parallelism(tmp_path):
    """One process stops after step 1; `--nproc 2 --tp 2` resumes it (tp is a noted setting, not a refused one) to
    step 2: the weights of a straight one-process run."""
    one = _cli([*_common(tmp_path), "--run-dir", str(tmp_path / "one")], tmp_path)
    assert one.returncode == 0, one.stderr
    first = _cli([*_common(tmp_path), "--run-dir", str(tmp_path / "r"), "--stop-after", "1"], tmp_path)
    assert first.returncode == 0, first.stderr
    then = _cli([*_common(tmp_path), "--run-dir", str(tmp_path / "r"), "--resume", "--nproc", "2", "--tp", "2"],
                tmp_path)
    assert then.returncode == 0, then.stderr
    ca = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)
    cb = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=False)
    assert_close("weights after resuming under TP = 2", _flat(ca["model"]), _flat(cb["model"]), FP32_RANKS)
