"""Agent settings refused or honoured as given: --max-turns that leaves the lookup task no answer turn, tree options
without --rollout tree, and a SIGTERM during the warm start (it stops at once and says nothing is saved)."""

from __future__ import annotations

import os
import signal
import time

import pytest

import longstraw.train.warmup as warmup
from longstraw import cli
from longstraw.train.config import TrainConfig


@pytest.mark.parametrize("hops,turns", [(1, 1), (2, 1), (2, 2)])
def test_max_turns_that_leave_no_answer_turn_are_refused(hops, turns):
    with pytest.raises(ValueError, match=f"--max-turns {turns} leaves no turn for the answer: lookup with --hops "
                                         f"{hops} .* use --max-turns {hops + 1} or more"):
        TrainConfig.from_flat(task="lookup", hops=hops, max_turns=turns)
    TrainConfig.from_flat(task="lookup", hops=hops, max_turns=hops + 1)
    TrainConfig.from_flat(task="passkey", max_turns=1)  # a single-turn task has one turn


def test_max_turns_below_hops_is_one_line_on_the_command_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--task", "lookup", "--hops", "2", "--max-turns", "2", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("longstraw train: error: --max-turns 2 leaves no turn"), err
    assert len(err.splitlines()) == 2 and not (tmp_path / "r").exists()  # the error, then the short usage line


@pytest.mark.parametrize("options", [{"tree_depth": 3}, {"tree_trunks": 4, "tree_leaves": 12},
                                     {"tree_trigger": "tokens", "tree_every": 8}, {"tree_advantage": "siblings"}])
def test_tree_options_without_rollout_tree_are_refused(options):
    flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in options.items())  # field order
    with pytest.raises(ValueError, match=f"{flags}: tree options apply to --rollout tree only"):
        TrainConfig.from_flat(task="lookup", **options)
    TrainConfig.from_flat(task="lookup", rollout="tree", **options)


def test_tree_options_without_rollout_tree_exit_2_on_the_command_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--tree-depth", "3", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--tree-depth 3: tree options apply to --rollout tree only" in err, err


def test_sigterm_during_the_warm_start_stops_within_seconds_and_says_nothing_is_saved(tmp_path, monkeypatch, capsys):
    """The SIGTERM arrives during the 2nd of 100 warm-start steps' gold responses: the run stops after that gold
    response's backward (not after 100 steps, nor only at a second signal), exits 128 + 15, and one line says that
    nothing is saved and how to start again."""
    backwards = []
    real = warmup.backward_group

    def counted(*args, **kwargs):
        backwards.append(time.monotonic())
        if len(backwards) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(warmup, "backward_group", counted)
    run = tmp_path / "run"
    code = cli.main(["train", "--model", "tiny-llama", "--task", "lookup", "--prompt-tokens", "600",
                     "--max-new-tokens", "128", "--group-size", "2", "--chunk-size", "256", "--eval-prompts", "0",
                     "--no-plot", "--warm-start-steps", "100", "--warm-start-batch", "1", "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert len(backwards) == 2, f"{len(backwards)} gold responses trained after the signal:\n{err}"
    assert "SIGTERM: stopping after the warm start's current gold response; nothing of the warm start is saved" in err
    assert (f"longstraw train: the warm start stopped by SIGTERM before its end; nothing is saved (its weights are no "
            f"step boundary, and {run} holds no checkpoint yet): start the run again with --overwrite") in err
    assert "longstraw train: stopped by SIGTERM" in err and "Traceback" not in err
    assert not (run / "checkpoint.pt").exists()
