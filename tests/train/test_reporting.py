"""The run's summary (summary.json and the end-of-run line): zero-advantage skips counted, the checkpoint's size."""

import json

import pytest

from longstraw.train.config import TrainConfig
from longstraw.train.reporting import run_totals, size_text, totals_line
from longstraw.train.trainer import Trainer


def test_run_totals_count_skips_and_steps_without_gradient():
    rows = [
        {"kept_groups": 2, "skipped_zero_advantage": 0, "dropped_groups": 0},
        {"kept_groups": 2, "skipped_zero_advantage": 1, "dropped_groups": 0},  # one group still gave a gradient
        {"kept_groups": 2, "skipped_zero_advantage": 2, "dropped_groups": 0},  # none did
        {"kept_groups": 0, "skipped_zero_advantage": 0, "dropped_groups": 2},  # every group dropped
    ]
    totals = run_totals(rows)
    assert totals == {"steps_with_skipped_groups": 2, "skipped_zero_advantage_groups": 3,
                      "steps_without_gradient": 2, "dropped_groups": 2}
    line = totals_line({"steps": 4, **totals})
    assert line == ("Of 4 steps, 2 skipped a group whose rewards were all equal and 2 had no gradient at all; dynamic "
                    "sampling dropped 2 such group(s).")
    assert size_text(1_620_000_000) == "1.62 GB" and size_text(2_500_000) == "2.5 MB"


@pytest.mark.parametrize("weights_only", [False, True])
def test_summary_counts_skipped_steps_and_states_the_checkpoint_size(tmp_path, capsys, weights_only):
    """tiny-llama (random weights) on passkey, groups of 2: most groups score 0 on both responses, a zero advantage,
    and are skipped. The summary counts those steps as metrics.jsonl records them, and gives the checkpoint's size on
    disk: with AdamW's two moments at least 3x the weights, without them (save_weights_only) under 1.5x."""
    run = tmp_path / "run"
    cfg = TrainConfig.from_flat(
        model="tiny-llama", task="passkey", prompt_tokens=256, group_size=2, max_new_tokens=2, steps=3, eval_prompts=1,
        plot=False, run_dir=str(run), save_weights_only=weights_only)
    trainer = Trainer(cfg)
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    trainer.run()
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    skipped = sum(r["skipped_zero_advantage"] > 0 for r in rows)
    assert len(rows) == 3 and skipped >= 1  # (a random 2-token answer rarely holds a digit of the key)
    assert summary["steps_with_skipped_groups"] == skipped and summary["steps_without_gradient"] == skipped
    assert summary["skipped_zero_advantage_groups"] == sum(r["skipped_zero_advantage"] for r in rows)
    size = (run / "checkpoint.pt").stat().st_size
    assert summary["checkpoint_bytes"] == size
    if weights_only:
        assert weights <= size < 1.5 * weights and summary["checkpoint_holds"] == "weights only (save_weights_only)"
    else:
        assert size >= 3 * weights and "AdamW" in summary["checkpoint_holds"]
    captured = capsys.readouterr()  # the run's progress and results on stdout, nothing of them on stderr
    assert f"Of 3 steps, {skipped} skipped a group whose rewards were all equal" in captured.out
    assert f"checkpoint.pt ({size / 1e6:.1f} MB: {summary['checkpoint_holds']})" in captured.out
    assert "step 1/3 |" in captured.out and "held-out greedy reward" in captured.out
    assert "step 1/3" not in captured.err and "held-out" not in captured.err
