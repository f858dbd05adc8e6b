"""The trainer's data: a jsonl file's held-out rows are never training rows, and a file too small for its split is
refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from longstraw import cli
from longstraw.models.tokenizer import load_tokenizer
from longstraw.train.config import TrainConfig
from longstraw.train.data import TaskData, split_rows
from longstraw.train.rundir import check_resume_config


def _rows(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Repeat {i}.", "answer": str(i)}) + "\n" for i in range(n)))
    return path


def test_jsonl_held_out_rows_are_never_training_rows(tmp_path):
    """Every prompt training draws over 300 steps lies outside the held-out rows, the held-out rows are distinct,
    and every seed holds out the same rows (seeds then differ by training only)."""
    data = _rows(tmp_path, 12)
    tokenizer = load_tokenizer("tiny-llama")
    held_by_seed = []
    for seed in (0, 1):
        cfg = TrainConfig.from_flat(
            model="tiny-llama", task="jsonl", data=str(data), eval_prompts=4, prompts_per_step=2, seed=seed,
            run_dir=str(tmp_path / "r"))
        task_data = TaskData(cfg, tokenizer, max_positions=2048)
        held = [ex.meta["line"] for ex in task_data.held_out()]
        trained = {ex.meta["line"] for step in range(300) for ex in task_data.examples(step)}
        assert len(held) == len(set(held)) == 4
        assert trained.isdisjoint(held) and trained | set(held) == set(range(1, 13))  # all 8 others are drawn
        held_by_seed.append(held)
    assert held_by_seed[0] == held_by_seed[1]
    # Without held-out prompts every row is a training row.
    assert split_rows(12, 0, "f") == (list(range(12)), [])


def test_a_jsonl_file_too_small_for_its_held_out_rows_is_refused_before_the_run_dir(tmp_path, capsys):
    data = _rows(tmp_path, 4)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--model", "tiny-llama", "--task", "jsonl", "--data", str(data), "--eval-prompts", "4",
                  "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert (f"{data} has 4 row(s), too few to hold out eval_prompts = 4 for the held-out evaluation (rows never "
            "trained on) and keep at least one to train on: lower --eval-prompts to at most 3") in err
    assert not run.exists()


def test_resuming_a_jsonl_run_with_other_eval_prompts_is_refused():
    """For a jsonl file eval_prompts sets which rows are trained on; for a generated task it only sets the
    evaluation."""
    saved = TrainConfig.from_flat(task="jsonl", data="d.jsonl", eval_prompts=2).to_flat()
    with pytest.raises(ValueError, match=r"settings that change what is trained: eval_prompts: 2 -> 3"):
        check_resume_config(saved, dict(saved, eval_prompts=3), False, "ck")
    generated = TrainConfig.from_flat(eval_prompts=2).to_flat()
    assert check_resume_config(generated, dict(generated, eval_prompts=3), False, "ck") == []
